"""The planner's engine (plan/engine_sim.py) against the engine core's own `Scheduler`, step
by step on the same random traces: the same decodes, prompt chunks, admissions and preemptions
in every step, colocated and on a P/D decode leg (remote KV), with a KV pool small enough to
preempt. A negative control: a budget that differs by one token is seen."""

from __future__ import annotations

import random

import pytest

from omni_pd.engines.core.kv_manager import KVManager
from omni_pd.engines.core.request import EngineRequest, Phase
from omni_pd.engines.core.scheduler import Scheduler
from omni_pd.kv.layout import BlockLayout
from omni_pd.plan.costs import Fit, StepCosts
from omni_pd.plan.engine_sim import SimEngine, SimRequest
from omni_pd.sampling import SamplingParams

BLOCK = 16
COSTS = StepCosts(Fit((1.0, 0.0, 0.0), 0.0, 1, 1), Fit((1.0, 0.0, 0.0), 0.0, 1, 1), 1, "cpu", "unit")


def _trace(seed: int, count: int, remote: bool) -> list[tuple[int, int, int, bool]]:
    """(arrival step, prompt, output, remote KV) per request."""
    rng = random.Random(seed)
    return [
        (rng.randint(0, 40), rng.randint(5, 300), rng.randint(1, 40), remote and rng.random() < 0.7)
        for _ in range(count)
    ]


class _Real:
    """The real scheduler, advanced the way ArEngine.step advances it."""

    def __init__(self, seqs: int, budget: int, blocks: int):
        layout = BlockLayout(block_size=BLOCK, num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
        self.kv = KVManager(layout, blocks)
        self.s = Scheduler(self.kv, seqs, budget)
        self.outputs: dict[str, int] = {}

    def add(self, name: str, prompt: int, output: int, remote: bool) -> None:
        r = EngineRequest(name, None, SamplingParams(max_tokens=output), prompt, list(range(prompt)))
        r.kv = object() if remote else None  # prefills_here is False: its KV comes by transfer
        self.outputs[name] = output
        self.s.add(r)

    def step(self) -> tuple:
        s = self.s
        decoding = [s.requests[r] for r in s.running]
        plan = s.schedule(decoding, lambda r: [], lambda r: True, lambda r: True)
        for r in plan.preempted:  # what ArEngine._preempted resets
            r.tokens, r.computed, r.kv = [], 0, None
        for r in plan.admitted:
            if not r.prefills_here:  # the decode leg's fetch: its first token, then it runs
                self._token(r, joins=True)
        for c in plan.chunks:
            c.request.computed = c.end
            if c.final:
                s.prefilling.remove(c.request.request_id)
                c.request.phase = Phase.RUNNING
                self._token(c.request, joins=True)
        for r in plan.decode:
            self._token(r, joins=False)
        return _summary(
            [r.request_id for r in plan.decode],
            [(c.request.request_id, c.start, c.end) for c in plan.chunks],
            [r.request_id for r in plan.admitted],
            [r.request_id for r in plan.preempted],
        )

    def _token(self, r: EngineRequest, joins: bool) -> None:
        r.tokens.append(0)
        if len(r.tokens) >= self.outputs[r.request_id]:
            self.s.remove(r)
            self.kv.free(r.blocks)
            r.blocks = []
        elif joins:
            self.s.running.append(r.request_id)

    @property
    def busy(self) -> bool:
        return bool(self.s.requests)


def _summary(decode, chunks, admitted, preempted) -> tuple:
    return (sorted(decode), chunks, admitted, preempted)


def _sim_step(engine: SimEngine) -> tuple:
    step = engine.schedule()
    engine.complete(step, 0.0)
    name = lambda r: f"r{r.index}"  # noqa: E731
    return _summary(
        [name(r) for r in step.decode],
        [(name(r), a, b) for r, a, b in step.chunks],
        [name(r) for r in step.admitted],
        [name(r) for r in step.preempted],
    )


def _run(trace, seqs: int, budget: int, blocks: int, sim_budget: int | None = None) -> int:
    real = _Real(seqs, budget, blocks)
    sim = SimEngine("e", "decode", COSTS, seqs, sim_budget or budget, blocks, BLOCK)
    step = 0
    while step <= 40 or real.busy or sim.has_work:
        for i, (at, prompt, output, remote) in enumerate(trace):
            if at == step:
                real.add(f"r{i}", prompt, output, remote)
                sim.add(SimRequest(i, prompt, output, 0.0, remote=remote))
        assert _sim_step(sim) == real.step(), f"step {step} differs"
        step += 1
        assert step < 5000, "no end"
    return sim.stats.preemptions


@pytest.mark.parametrize("remote", [False, True], ids=["colocated", "decode-leg"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_simulated_engine_steps_as_the_real_scheduler(seed, remote):
    preemptions = _run(_trace(seed, 30, remote), seqs=8, budget=96, blocks=60)
    assert preemptions > 0  # the pool is small enough that preemption is exercised


def test_a_roomy_pool_preempts_nothing_and_still_matches():
    assert _run(_trace(7, 30, False), seqs=64, budget=512, blocks=4096) == 0


def test_negative_control_a_different_budget_is_seen():
    with pytest.raises(AssertionError, match="differs"):
        _run(_trace(1, 30, False), seqs=8, budget=96, blocks=60, sim_budget=97)
