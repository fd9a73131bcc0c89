"""The engine's queues and its admission: which waiting requests start this step.

Each step admits waiting requests oldest first while the step's budget allows: `max_num_seqs`
requests held, `max_num_batched_tokens` tokens computed (a prefill costs the prompt positions it
computes, a remote prompt's KV read one, a decode one), and free KV blocks for each admitted
request's prompt plus `max_tokens` (its cached prefix counts as held). The first request that does
not fit stops admission, so a long prompt is not overtaken. The result is a `SchedulerOutput`
the engine executes, beside the running requests it picked to decode before the step's KV reads
completed (a request whose KV arrives this step decodes from the next one, as an admitted
prompt does).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from .kv_manager import KVManager
from .request import EngineRequest, Phase


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[str] = deque()
        self.fetching: list[str] = []
        self.running: list[str] = []

    def add(self, request: EngineRequest) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request.request_id)

    def remove(self, request: EngineRequest) -> None:
        """Out of the map and its queue; its blocks are the engine's to free."""
        del self.requests[request.request_id]
        queue = {Phase.WAITING: self.waiting, Phase.FETCHING: self.fetching, Phase.RUNNING: self.running}[
            request.phase
        ]
        if request.request_id in queue:
            queue.remove(request.request_id)

    def get(self, request_id: str) -> EngineRequest | None:
        return self.requests.get(request_id)

    def decoding(self, ready: Callable[[EngineRequest], bool]) -> list[EngineRequest]:
        """The running requests that decode this step (`ready(r)`: it can, now)."""
        return [self.requests[r] for r in self.running if ready(self.requests[r])]

    def admit(
        self,
        num_decoding: int,
        match_prefix: Callable[[EngineRequest], list[int]],
        can_start: Callable[[EngineRequest], bool],
    ) -> list[EngineRequest]:
        """The waiting requests that start this step, their blocks allocated. `match_prefix(r)`:
        the cached blocks a waiting request starts from (held for it); `can_start(r)`: resources
        it needs beyond blocks."""
        budget = self.max_num_batched_tokens - num_decoding
        slots = self.max_num_seqs - (len(self.requests) - len(self.waiting))  # held: admitted
        admitted: list[EngineRequest] = []
        while self.waiting and len(admitted) < slots:
            request = self.requests[self.waiting[0]]
            # A pushed prompt holds its reserved blocks from the start (they counted against
            # admission while reserved); it matches nothing more.
            held = len(request.blocks)
            cached = match_prefix(request) if not held else []
            # A remote prompt's KV arrives by transfer: admitting it computes no token.
            cost = request.prompt_len - len(cached) * self.kv.block_size if request.prefills_here else 1
            positions = request.prompt_len + request.params.max_tokens
            if (
                cost > budget
                or not can_start(request)
                or self.kv.blocks_for(positions) - len(cached) - held > self.kv.num_free
            ):
                self.kv.free(cached)  # oldest first: a long prompt is not overtaken
                break
            request.blocks = request.blocks + cached + self.kv.allocate(positions, have=len(cached) + held)
            request.cached_len = len(cached) * self.kv.block_size
            self.waiting.popleft()
            request.admitted_at = time.perf_counter()
            request.phase = Phase.RUNNING  # until its start says otherwise (fetching)
            budget -= cost
            admitted.append(request)
        return admitted
