"""A discrete-event simulation of one layout serving one workload at one offered rate.

DistServe's method (Zhong et al., OSDI 2024) fits a latency model of the prefill and decode
passes to a profile, then estimates each placement's goodput by simulating requests through it
(its placement search calls a simulator; its M/D/1 formula for the prefill queue,
TTFT = D + R*D^2 / (2*(1 - R*D)), is the closed form of the simplest case, one prompt of D per
step). This module is that simulator for omni-pd's engines: costs.py is the latency model,
engine_sim.py the engine's own step rule (chunked prefill, decodes first, the token budget,
admission within seats and KV blocks, preemption), and this file the arrivals, the router and
the P/D handoff. A simulator rather than the closed forms because colocated replicas mix prompt
chunks and decodes in one step, which no queueing formula covers, and because the SLO that
decides goodput is per request (its own TTFT, its own mean time per output token).

Arrivals are the bench's seeded Poisson process; each request goes to a replica chosen as the
orchestrator's router chooses (replicas with KV room for its prompt plus max_tokens first, then
the fewest requests in flight, then the fewest prompt tokens in flight, then the lowest index).
P/D: the decode replica is chosen first, then the prefill replica; the prefill leg's first token
is the request's TTFT; after `hop_ms` (the orchestrator's relay) the request waits at the decode
leg, whose admission copies its KV (bytes / bandwidth, in that step) and frees the prefill leg's
lease on those blocks. An engine steps whenever it has work; a step's composition is fixed when
it starts, so a request arriving mid-step waits for the next one.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

from ..bench.stats import RequestRecord
from .costs import StepCosts
from .engine_sim import EngineStats, SimEngine, SimRequest, Step
from .layouts import Layout

# Qwen3-Omni-30B-A3B's thinker: 4 KV heads of 128 dims, a K and a V row per position and layer.
KV_HEADS, HEAD_DIM = 4, 128
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_TRANSFER_MS = 1.0  # the KV copy where the profile measured no bandwidth
COPY_PASSES = 3  # the copy reads and writes every byte; the decode leg's checksum reads it again


@dataclass(frozen=True)
class EngineArgs:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    kv_blocks: int = 1024
    block_size: int = 16


@dataclass(frozen=True)
class Handoff:
    """The P/D handoff: the relay between the legs, and the KV copy's cost per prompt token."""

    hop_ms: float = 2.0
    bytes_per_token: float = 0.0
    bandwidth: float | None = None

    def copy_ms(self, prompt: int) -> float:
        if not self.bandwidth or not self.bytes_per_token:
            return DEFAULT_TRANSFER_MS
        return COPY_PASSES * prompt * self.bytes_per_token / self.bandwidth * 1e3


def kv_bytes_per_token(costs: StepCosts) -> float:
    """The thinker's KV bytes per position at the profile's layers and dtype."""
    return 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES.get(costs.dtype, 4) * costs.layers


@dataclass(frozen=True)
class Contention:
    """How much slower a pass runs while another worker on the host is mid-step (they share the
    memory bus and caches): measured with `bench roofline` pinned to one core while another
    pinned roofline keeps the other core busy (docs/planner.md). 1.0: no interference."""

    prefill: float = 1.0
    decode: float = 1.0


@dataclass
class SimRun:
    """Each request's record (as the bench keeps them), the wall time from the first arrival to
    the last answer, and each engine's counters."""

    records: list[RequestRecord]
    wall_s: float
    engines: dict[str, EngineStats] = field(default_factory=dict)


class _Pool:
    """One stage's replicas and the router's counters (orchestrator/replicas.py's rule)."""

    def __init__(self, engines: list[SimEngine]):
        self.engines = engines
        self.in_flight = [0] * len(engines)
        self.tokens = [0] * len(engines)

    def pick(self, request: SimRequest) -> int:
        def key(k: int) -> tuple:
            engine = self.engines[k]
            room = engine.blocks_for(request.prompt + request.output) <= engine.free
            return (not room, self.in_flight[k], self.tokens[k], k)

        k = min(range(len(self.engines)), key=key)
        self.in_flight[k] += 1
        self.tokens[k] += request.prompt
        return k

    def release(self, k: int, request: SimRequest) -> None:
        self.in_flight[k] -= 1
        self.tokens[k] -= request.prompt


class Simulation:
    def __init__(
        self,
        layout: Layout,
        costs: StepCosts,
        args: EngineArgs,
        handoff: Handoff,
        overhead_ms: float = 0.0,
        contention: Contention = Contention(),
    ):
        self.layout, self.handoff, self.overhead_ms = layout, handoff, overhead_ms
        self.contention = contention

        def engines(role: str, count: int) -> list[SimEngine]:
            return [
                SimEngine(
                    f"{role}{k}",
                    role,
                    costs,
                    args.max_num_seqs,
                    args.max_num_batched_tokens,
                    args.kv_blocks,
                    args.block_size,
                )
                for k in range(count)
            ]

        self.prefill: _Pool | None = None
        if layout.disaggregated:
            self.prefill = _Pool(engines("prefill", layout.prefill))
            self.decode = _Pool(engines("decode", layout.decode))
        else:
            self.decode = _Pool(engines("colocated", layout.replicas))
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._where: dict[int, tuple[int, int | None]] = {}  # request -> (decode k, prefill k)
        self._prefill_of: dict[int, SimEngine] = {}

    def _pools(self) -> list[_Pool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    def _at(self, when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def run(self, requests: list[SimRequest]) -> SimRun:
        for request in requests:
            self._at(request.arrival, functools.partial(self._arrive, request))
        while self._events:
            now, _, action = heapq.heappop(self._events)
            action(now)
        unfinished = [r.index for r in requests if r.finished_at is None]
        assert not unfinished, f"requests {unfinished[:5]} never finished (a simulation bug)"
        records = [
            RequestRecord(
                ok=True,
                no_speech=True,
                ttft_s=(r.first_token_at or 0.0) - r.arrival,
                e2e_s=(r.finished_at or 0.0) - r.arrival,
                output_tokens=r.output,
            )
            for r in requests
        ]
        wall = max((r.finished_at or 0.0) for r in requests) - min(r.arrival for r in requests)
        pools = [p for p in (self.prefill, self.decode) if p is not None]
        return SimRun(records, wall, {e.name: e.stats for p in pools for e in p.engines})

    # ---- events ------------------------------------------------------------------------------
    def _arrive(self, request: SimRequest, now: float) -> None:
        k = self.decode.pick(request)  # P/D: the decode replica first, as the router does
        if self.prefill is None:
            self._where[request.index] = (k, None)
            self._submit(self.decode.engines[k], request, now)
            return
        p = self.prefill.pick(request)
        self._where[request.index] = (k, p)
        self._submit(self.prefill.engines[p], request, now)

    def _submit(self, engine: SimEngine, request: SimRequest, now: float) -> None:
        engine.add(request)
        self._kick(engine, now)

    def _kick(self, engine: SimEngine, now: float) -> None:
        """Start a step on `engine` if it is idle and has something to do now."""
        while not engine.busy and engine.has_work:
            step = engine.schedule()
            if step.empty:
                return  # waiting on blocks another engine holds: a release kicks it again
            # A step that starts while another worker computes runs at the contended costs.
            shared = any(e.busy for p in self._pools() for e in p.engines if e is not engine)
            factors = (self.contention.prefill, self.contention.decode) if shared else (1.0, 1.0)
            ms = engine.duration_ms(
                step, lambda r: self.handoff.copy_ms(r.prompt), self.overhead_ms, *factors
            )
            engine.busy = True
            self._at(now + ms / 1e3, functools.partial(self._step_end, engine, step))

    def _step_end(self, engine: SimEngine, step: Step, now: float) -> None:
        out = engine.complete(step, now)
        engine.busy = False
        for request in out.published:  # the prefill leg is done with it
            k, p = self._where[request.index]
            assert self.prefill is not None and p is not None
            self.prefill.release(p, request)
            self._prefill_of[request.index] = engine
            self._at(now + self.handoff.hop_ms / 1e3, functools.partial(self._handoff, request, k))
        for request in out.fetched:  # its KV is read: the prefill leg's lease ends
            source = self._prefill_of.pop(request.index)
            source.free += request.leased
            request.leased = 0
            self._kick(source, now)
        for request in out.finished:
            self.decode.release(self._where[request.index][0], request)
        self._kick(engine, now)

    def _handoff(self, request: SimRequest, k: int, now: float) -> None:
        request.remote, request.tokens, request.computed = True, 0, 0
        self._submit(self.decode.engines[k], request, now)


def simulate(
    layout: Layout,
    costs: StepCosts,
    args: EngineArgs,
    handoff: Handoff,
    pairs: list[tuple[int, int]],
    arrivals: list[float],
    overhead_ms: float = 0.0,
    contention: Contention = Contention(),
) -> SimRun:
    """Requests of (prompt positions, output tokens) `pairs` arriving at `arrivals` (s) through
    `layout`, every worker stepping at `costs` (times `contention` while another computes)."""
    requests = [SimRequest(i, p, o, t) for i, ((p, o), t) in enumerate(zip(pairs, arrivals))]
    return Simulation(layout, costs, args, handoff, overhead_ms, contention).run(requests)
