"""One engine of the simulation: the engine core's step rule on plain numbers.

A mirror of engines/core/scheduler.py and the step of ar_engine.py / pd_legs.py (test_plan_engine
checks it against the real `Scheduler`, step by step). Each step:
1. the running requests decode, one token each, first (one budget token each);
2. what is left of `max_num_batched_tokens` goes to prompt chunks, oldest first: prompts
   part-way through (chunked prefill), then waiting requests admitted within `max_num_seqs`
   seats and the free KV blocks (a decode leg's request whose KV comes from a prefill engine
   costs one budget token, its KV copied in this step);
3. blocks are allocated as positions need them; when none is free the newest request is
   preempted (its blocks freed, back to the front of the waiting queue, computed again from its
   prompt and its tokens replayed; nothing new is admitted in that step);
4. the step's chunks run as one prefill pass, then its decodes as one decode pass; a prompt whose
   last chunk ran has its first token at the step's end and decodes from the next step.
Roles: `colocated` (prefill and decode), `prefill` (a P/D prefill leg: a request ends with its
prompt, its blocks leased until the decode leg has read them), `decode` (a P/D decode leg).
Left out: the prefix cache (the bench's prompts share no prefix; a preempted request's prompt is
computed again whole, though its blocks might still be cached), multimodal inputs, sampling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from .costs import StepCosts

ROLES = ("colocated", "prefill", "decode")


class Phase(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class SimRequest:
    """A request's lengths and times, and its state on the engine that holds it now."""

    index: int
    prompt: int  # positions the prompt fills
    output: int  # tokens it generates (its max_tokens: all of them, as with --ignore-eos)
    arrival: float
    remote: bool = False  # on a decode leg: its prompt's KV comes from a prefill engine
    computed: int = 0  # prompt positions computed
    tokens: int = 0  # tokens it has (a preempted request replays from 0)
    blocks: int = 0  # KV blocks it holds on its engine
    leased: int = 0  # P/D: blocks its prefill engine holds for the decode leg to read
    order: int = 0  # admission order: the newest is preempted first
    phase: Phase = Phase.WAITING
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def position(self) -> int:
        """Where its next token goes: the positions cached before its next decode."""
        return self.prompt + self.tokens - 1


@dataclass
class Step:
    decode: list[SimRequest] = field(default_factory=list)
    chunks: list[tuple[SimRequest, int, int]] = field(default_factory=list)  # (request, start, end)
    fetched: list[SimRequest] = field(default_factory=list)  # decode leg: admitted, KV copied now
    preempted: list[SimRequest] = field(default_factory=list)
    admitted: list[SimRequest] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.chunks or self.fetched or self.preempted)


@dataclass
class Outcome:
    """What a step's end changed: requests that got their first token, finished, were
    published by a prefill leg, or had their KV read by a decode leg."""

    first: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    published: list[SimRequest] = field(default_factory=list)
    fetched: list[SimRequest] = field(default_factory=list)


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    max_decode_batch: int = 0
    max_prefill_tokens: int = 0
    min_prefill_tokens: int | None = None
    peak_blocks: int = 0


class SimEngine:
    def __init__(
        self,
        name: str,
        role: str,
        costs: StepCosts,
        max_num_seqs: int,
        budget: int,
        kv_blocks: int,
        block_size: int = 16,
    ):
        assert role in ROLES, role
        self.name, self.role, self.costs = name, role, costs
        self.max_num_seqs, self.budget = max_num_seqs, budget
        self.kv_blocks, self.block_size = kv_blocks, block_size
        self.free = kv_blocks
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.admissions = 0
        self.busy = False
        self.stats = EngineStats()

    def add(self, request: SimRequest) -> None:
        request.phase = Phase.WAITING
        self.waiting.append(request)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.num_requests)

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> Step:
        """This step's work (the module's rule, as `Scheduler.schedule`)."""
        step = Step()
        decoding = list(self.running)
        budget = self.budget - len(decoding)
        wanted = [(r, r.position + 1) for r in decoding]
        chunks: list[tuple[SimRequest, int, int]] = []
        for r in self.prefilling:
            size = self._chunk_size(r.prompt - r.computed, budget)
            if size:
                chunks.append((r, r.computed, r.computed + size))
                budget -= size
        active = sorted(wanted + [(r, end) for r, _, end in chunks], key=lambda p: p[0].order)
        lost: set[int] = set()
        for request, positions in active:
            if id(request) in lost:
                continue
            if not self._grow(request, positions, step, lost):
                break
        step.decode = [r for r in decoding if id(r) not in lost]
        step.chunks = [c for c in chunks if id(c[0]) not in lost]
        if not step.preempted:
            self._admit(step, budget)
        return step

    @staticmethod
    def _chunk_size(remaining: int, budget: int) -> int:
        """Chunked prefill: what is left of the prompt, or what is left of the budget."""
        return remaining if remaining <= budget else max(budget, 0)

    def _grow(self, request: SimRequest, positions: int, step: Step, lost: set[int]) -> bool:
        needed = self.blocks_for(positions) - request.blocks
        while needed > self.free:
            victim = max(
                (r for r in self.running + self.prefilling if id(r) not in lost), key=lambda r: r.order
            )
            lost.add(id(victim))
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return False
        if needed > 0:
            request.blocks += needed
            self.free -= needed
        return True

    def _preempt(self, request: SimRequest) -> None:
        (self.running if request.phase is Phase.RUNNING else self.prefilling).remove(request)
        self.free += request.blocks
        request.blocks = request.computed = request.tokens = 0
        request.remote = False  # computed again here, from its prompt
        request.phase = Phase.WAITING
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _admit(self, step: Step, budget: int) -> None:
        seats = self.max_num_seqs - (self.num_requests - len(self.waiting))
        admitted = 0
        while self.waiting and admitted < seats:
            request = self.waiting[0]
            if request.remote:
                size, cost, positions, fits = 0, 1, request.prompt, budget >= 1
            else:
                size = self._chunk_size(request.prompt, budget)
                cost, positions, fits = size, size, size > 0
            if not fits or self.blocks_for(positions) > self.free:
                break  # oldest first: a long prompt is not overtaken
            request.blocks = self.blocks_for(positions)
            self.free -= request.blocks
            self.waiting.popleft()
            self.admissions += 1
            request.order = self.admissions
            admitted += 1
            step.admitted.append(request)
            budget -= cost
            if request.remote:
                step.fetched.append(request)
                request.phase = Phase.RUNNING
            else:
                request.phase = Phase.PREFILLING
                self.prefilling.append(request)
                step.chunks.append((request, 0, positions))

    # ---- one step's cost and end ------------------------------------------------------------
    def duration_ms(
        self,
        step: Step,
        transfer_ms: Callable[[SimRequest], float],
        overhead_ms: float,
        prefill_factor: float = 1.0,
        decode_factor: float = 1.0,
    ) -> float:
        """The KV copies of the requests it admits, one prefill pass, one decode pass (each
        pass's cost times its factor: a neighbour's contention)."""
        ms = overhead_ms + sum(transfer_ms(r) for r in step.fetched)
        if step.chunks:
            tokens = sum(end - start for _, start, end in step.chunks)
            self.stats.max_prefill_tokens = max(self.stats.max_prefill_tokens, tokens)
            low = self.stats.min_prefill_tokens
            self.stats.min_prefill_tokens = tokens if low is None else min(low, tokens)
            ms += prefill_factor * self.costs.prefill_ms(
                [(end - start, start) for _, start, end in step.chunks]
            )
        if step.decode:
            self.stats.max_decode_batch = max(self.stats.max_decode_batch, len(step.decode))
            ms += decode_factor * self.costs.decode_ms(len(step.decode), sum(r.position for r in step.decode))
        self.stats.steps += 1
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.kv_blocks - self.free)
        return ms

    def complete(self, step: Step, now: float) -> Outcome:
        """The step's end at `now`: chunks computed, first tokens, decoded tokens, finishes."""
        out = Outcome()
        for request in step.fetched:  # its first token came from the prefill leg
            out.fetched.append(request)
            self._token(request, now, out, joins=True)
        for request, _, end in step.chunks:
            request.computed = end
            if end < request.prompt:
                continue
            self.prefilling.remove(request)
            if self.role == "prefill":  # published: its blocks leased to the decode leg
                request.leased, request.blocks = request.blocks, 0
                request.tokens, request.phase = 1, Phase.DONE
                if request.first_token_at is None:
                    request.first_token_at = now
                    out.first.append(request)
                out.published.append(request)
                continue
            request.phase = Phase.RUNNING
            self._token(request, now, out, joins=True)
        for request in step.decode:
            self._token(request, now, out, joins=False)
        return out

    def _token(self, request: SimRequest, now: float, out: Outcome, joins: bool) -> None:
        """A request's next token; `joins`: its first here (after its prompt, or its KV's
        arrival), from which it runs."""
        request.tokens += 1
        if request.first_token_at is None:
            request.first_token_at = now
            out.first.append(request)
        if request.tokens >= request.output:
            if not joins:
                self.running.remove(request)
            self.free += request.blocks
            request.blocks, request.phase, request.finished_at = 0, Phase.DONE, now
            out.finished.append(request)
        elif joins:
            self.running.append(request)
