"""The engine's queues and what each step computes: decodes first, then prompt chunks.

Each step has a budget of `max_num_batched_tokens` tokens (vLLM's meaning). The running requests
that decode take one token each, first (Sarathi-Serve's rule, so a long prompt never stalls
them). What is left goes to prompts, oldest first: prompts already part-way through their prefill
(PREFILLING), then waiting requests admitted within `max_num_seqs` seats. With chunked prefill
(vLLM's `enable_chunked_prefill`, on by default) a prompt takes what is left of the budget and
goes on next step; a prompt the runner cannot compute in chunks (`can_chunk` False) is computed
whole, and one longer than the budget is computed whole in a step where no other prompt is.
Without chunked prefill a prompt must fit what is left whole. The first waiting request that does
not fit stops admission, so a long prompt is not overtaken.

KV blocks are allocated as tokens need them: a decode one block each time its position crosses
into a new block, a prompt chunk the blocks its positions fill (its cached prefix counts as
held). Nothing is reserved for `max_tokens`. When a running or prefilling request needs a block
and none is free, the newest such request is preempted (vLLM's default policy: its blocks are
freed and it goes back to the front of the waiting queue, to be computed again); requests are
served oldest first, so the oldest request always finishes. A step that preempts admits no new
request. A decode-leg request whose KV is in flight (FETCHING) is never preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, MutableSequence

from .kv_manager import KVManager
from .request import EngineRequest, Phase


@dataclass
class Chunk:
    """Prompt positions `start .. end` of a request, computed this step."""

    request: EngineRequest
    start: int
    end: int

    @property
    def final(self) -> bool:
        return self.end == self.request.prompt_len


@dataclass
class SchedulerOutput:
    """What one step computes: decodes, prompt chunks (of PREFILLING and newly admitted
    requests, in that order), the requests admitted this step (each with its blocks), and the
    requests preempted (their blocks freed, back at the front of the waiting queue)."""

    decode: list[EngineRequest] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    admitted: list[EngineRequest] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, chunked: bool = True):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = chunked
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[str] = deque()
        self.fetching: list[str] = []
        self.prefilling: list[str] = []  # admitted, prompt part-way through (admission order)
        self.running: list[str] = []
        self.num_preemptions = 0  # since start, as vLLM's counter
        self._admissions = 0  # admission order, across preemptions

    def add(self, request: EngineRequest) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request.request_id)

    def remove(self, request: EngineRequest) -> None:
        """Out of the map and its queue; its blocks are the engine's to free."""
        del self.requests[request.request_id]
        queue = self._queue(request.phase)
        if request.request_id in queue:
            queue.remove(request.request_id)

    def _queue(self, phase: Phase) -> MutableSequence[str]:
        queues: dict[Phase, MutableSequence[str]] = {
            Phase.WAITING: self.waiting,
            Phase.FETCHING: self.fetching,
            Phase.PREFILLING: self.prefilling,
            Phase.RUNNING: self.running,
        }
        return queues[phase]

    def get(self, request_id: str) -> EngineRequest | None:
        return self.requests.get(request_id)

    def decoding(self, ready: Callable[[EngineRequest], bool]) -> list[EngineRequest]:
        """The running requests that can decode now (`ready(r)`)."""
        return [self.requests[r] for r in self.running if ready(self.requests[r])]

    @property
    def num_running(self) -> int:
        """Requests computing (decoding, prefilling or reading their KV): vLLM's `running`."""
        return len(self.running) + len(self.prefilling) + len(self.fetching)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(
        self,
        decoding: list[EngineRequest],
        match_prefix: Callable[[EngineRequest], list[int]],
        can_start: Callable[[EngineRequest], bool],
        can_chunk: Callable[[EngineRequest], bool],
    ) -> SchedulerOutput:
        """This step's work (see the module doc). `decoding`: the running requests ready to
        decode; `match_prefix(r)`: the cached blocks a waiting request starts from (held for
        it); `can_start(r)`: resources it needs beyond blocks; `can_chunk(r)`: whether its prompt
        may be computed over several steps."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens - len(decoding)
        wanted: list[tuple[EngineRequest, int]] = [(r, r.position + 1) for r in decoding]
        prefilling_chunks: list[Chunk] = []
        for request in (self.requests[r] for r in self.prefilling):
            size = self._chunk_size(request, request.computed, budget, bool(prefilling_chunks), can_chunk)
            if size == 0:
                continue
            prefilling_chunks.append(Chunk(request, request.computed, request.computed + size))
            budget -= size
        # Blocks, oldest first: a request short of one preempts the newest.
        active = sorted(wanted + [(c.request, c.end) for c in prefilling_chunks], key=lambda p: p[0].order)
        lost: set[str] = set()
        for request, positions in active:
            if request.request_id in lost:
                continue
            if not self._grow(request, positions, out, lost):
                break
        out.decode = [r for r in decoding if r.request_id not in lost]
        out.chunks = [c for c in prefilling_chunks if c.request.request_id not in lost]
        if not out.preempted:
            self._admit(out, budget, match_prefix, can_start, can_chunk)
        return out

    def _grow(self, request: EngineRequest, positions: int, out: SchedulerOutput, lost: set[str]) -> bool:
        """Blocks for `positions` positions of `request`, preempting the newest requests while
        none is free; False when `request` itself was the newest (preempted)."""
        needed = self.kv.blocks_for(positions) - len(request.blocks)
        while needed > self.kv.num_free:
            victim = self._newest(lost)
            lost.add(victim.request_id)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        if needed > 0:
            request.blocks = request.blocks + self.kv.allocate(positions, have=len(request.blocks))
        return True

    def _newest(self, lost: set[str]) -> EngineRequest:
        candidates = [self.requests[r] for r in self.running + self.prefilling if r not in lost]
        return max(candidates, key=lambda r: r.order)

    def _preempt(self, request: EngineRequest) -> None:
        """Back to the front of the waiting queue, its blocks freed (the engine resets what it
        computed: `ArEngine._preempted`)."""
        self._queue(request.phase).remove(request.request_id)
        self.kv.free(request.blocks)
        request.blocks = []
        request.phase = Phase.WAITING
        self.waiting.appendleft(request.request_id)
        self.num_preemptions += 1

    def _chunk_size(
        self,
        request: EngineRequest,
        start: int,
        budget: int,
        others: bool,
        can_chunk: Callable[[EngineRequest], bool],
    ) -> int:
        """Prompt positions from `start` this step computes of `request` (0: none this step)."""
        remaining = request.prompt_len - start
        if remaining <= budget:
            return remaining
        if self.chunked and can_chunk(request):
            return max(budget, 0)
        # Whole or not at all: one that does not fit takes a step where no other prompt runs.
        return remaining if not others and budget > 0 else 0

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        match_prefix: Callable[[EngineRequest], list[int]],
        can_start: Callable[[EngineRequest], bool],
        can_chunk: Callable[[EngineRequest], bool],
    ) -> None:
        """Waiting requests, oldest first, within the seats, the budget and the free blocks
        (admission never preempts)."""
        seats = self.max_num_seqs - (len(self.requests) - len(self.waiting))
        while self.waiting and len(out.admitted) < seats:
            request = self.requests[self.waiting[0]]
            # A pushed prompt holds its blocks from the start (the decode leg's reservation).
            held = len(request.blocks)
            cached = match_prefix(request) if not held else []
            start = len(cached) * self.kv.block_size
            if request.prefills_here:
                size = self._chunk_size(request, start, budget, bool(out.chunks), can_chunk)
                cost, positions = size, start + size
            else:  # its KV arrives by transfer: admitting it computes one token
                size, cost, positions = 0, 1, request.prompt_len
            fits = size > 0 if request.prefills_here else budget >= 1
            if (
                not fits
                or not can_start(request)
                or self.kv.blocks_for(positions) - len(cached) - held > self.kv.num_free
            ):
                self.kv.free(cached)  # oldest first: a long prompt is not overtaken
                break
            request.blocks = request.blocks + cached + self.kv.allocate(positions, have=len(cached) + held)
            request.cached_len = request.computed = start
            self.waiting.popleft()
            request.admitted_at = time.perf_counter()
            request.order = self._admissions = self._admissions + 1
            # Its start (the engine's) moves it on: running, fetching or prefilling.
            request.phase = Phase.PREFILLING if request.prefills_here else Phase.RUNNING
            if request.prefills_here:
                self.prefilling.append(request.request_id)
                out.chunks.append(Chunk(request, start, positions))
            budget -= cost
            out.admitted.append(request)
