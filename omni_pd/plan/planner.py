"""The plan: every layout (and, colocated, every chunk budget) simulated at every rate, each
level summarised under every SLO pair, and per pair the layout with the most goodput."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from .costs import StepCosts
from .layouts import Layout
from .simulate import Contention, EngineArgs, Handoff, SimRun, simulate
from .slo import SloPair, summarize
from .workload import Workload, arrivals

BUDGET_KEY = "max_num_batched_tokens"


@dataclass(frozen=True)
class Config:
    """A layout at one token budget per step, its workers at `threads` each."""

    layout: Layout
    budget: int
    threads: int
    swept: bool = False  # one of several budgets: the label names it

    @property
    def label(self) -> str:
        return f"{self.layout.label}@{BUDGET_KEY}={self.budget}" if self.swept else self.layout.label


@dataclass(frozen=True)
class PlanInputs:
    workload: Workload
    rates: list[float]
    num_requests: int
    engine: EngineArgs
    handoff: Handoff
    slos: list[SloPair]
    costs_for: Callable[[int], StepCosts]  # a worker's costs by its threads
    overhead_ms: float = 0.0
    contention: Contention = Contention()


@dataclass
class Prediction:
    config: Config
    rate: float
    slo: str
    row: dict  # the bench's fields: goodput_req_per_s, ttft_ms_p50, ...
    notes: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.row.get("goodput_req_per_s") or 0.0


def configs_for(
    layouts: list[Layout], budgets: list[int], default_budget: int, cpus: Callable[[Layout], int]
) -> list[Config]:
    """P/D layouts at `default_budget`; colocated ones at each of `budgets` (or the default)."""
    out: list[Config] = []
    for layout in layouts:
        sweep = budgets if budgets and not layout.disaggregated else [default_budget]
        out.extend(Config(layout, b, cpus(layout), swept=len(sweep) > 1) for b in sweep)
    return out


def _range_notes(run: SimRun, costs: StepCosts) -> list[str]:
    """Where the simulation asked the cost fit for steps outside the profiled rows."""
    notes = []
    batch = max((s.max_decode_batch for s in run.engines.values()), default=0)
    if batch > costs.decode.hi:
        notes.append(f"decode batch {batch} > profiled {costs.decode.hi}")
    tokens = max((s.max_prefill_tokens for s in run.engines.values()), default=0)
    if tokens > costs.prefill.hi:
        notes.append(f"prefill pass {tokens} tokens > profiled {costs.prefill.hi}")
    low = min((s.min_prefill_tokens for s in run.engines.values() if s.min_prefill_tokens), default=None)
    if low is not None and low < costs.prefill.lo:
        notes.append(f"prefill pass {low} tokens < profiled {costs.prefill.lo}")
    preempted = sum(s.preemptions for s in run.engines.values())
    if preempted:
        notes.append(f"{preempted} preemptions")
    return notes


def predict(configs: list[Config], inputs: PlanInputs) -> list[Prediction]:
    """Every config at every rate: one simulation each, summarised under every SLO pair."""
    pairs = inputs.workload.pairs(inputs.num_requests)
    out: list[Prediction] = []
    for config in configs:
        costs = inputs.costs_for(config.threads)
        engine = replace(inputs.engine, max_num_batched_tokens=config.budget)
        for rate in inputs.rates:
            times = arrivals(rate, inputs.num_requests, inputs.workload.seed)
            run = simulate(
                config.layout,
                costs,
                engine,
                inputs.handoff,
                pairs,
                times,
                inputs.overhead_ms,
                inputs.contention,
            )
            notes = _range_notes(run, costs)
            out.extend(Prediction(config, rate, slo.name, summarize(run, slo), notes) for slo in inputs.slos)
    return out


def _score(predictions: list[Prediction]) -> tuple[float, float]:
    """Goodput at the best rate, then the sum over rates (the tie-break)."""
    return max((p.goodput for p in predictions), default=0.0), sum(p.goodput for p in predictions)


def best_per_layout(predictions: list[Prediction], slo: str) -> dict[str, Config]:
    """Each layout's best config (its chunk budget) under `slo`."""
    by_config: dict[Config, list[Prediction]] = {}
    for p in predictions:
        if p.slo == slo:
            by_config.setdefault(p.config, []).append(p)
    best: dict[str, Config] = {}
    for config, preds in by_config.items():
        current = best.get(config.layout.label)
        if current is None or _score(preds) > _score(by_config[current]):
            best[config.layout.label] = config
    return best


# How far ahead of the runner-up a pick must be predicted to count as decisive: the plan's largest
# per-layout error against a measured run on a steady host (19%, docs/benchmarks.md, the sixth
# sitting). Closer than that, the plan cannot tell the two apart.
RESOLUTION = 0.2


@dataclass(frozen=True)
class Recommendation:
    slo: str
    config: Config
    goodput: float  # at its best rate
    rate: float
    runner_up: Config | None
    runner_up_goodput: float
    resolution: float = RESOLUTION

    @property
    def margin(self) -> float | None:
        """How far the pick is predicted ahead of the runner-up, as a fraction of its goodput."""
        if self.runner_up is None or self.goodput <= 0:
            return None
        return (self.goodput - self.runner_up_goodput) / self.goodput

    @property
    def decisive(self) -> bool:
        margin = self.margin
        return margin is None or margin > self.resolution


def recommend(predictions: list[Prediction], slo: str, resolution: float = RESOLUTION) -> Recommendation:
    """The layout with the most goodput at its best rate under `slo` (then the most over all
    rates, then the fewest workers); not decisive where the next layout is within `resolution`."""
    best = best_per_layout(predictions, slo)
    scored = []
    for config in best.values():
        preds = [p for p in predictions if p.slo == slo and p.config == config]
        scored.append((_score(preds), -config.layout.workers, config, preds))
    scored.sort(key=lambda s: (s[0], s[1]), reverse=True)
    (score, _, config, preds), rest = scored[0], scored[1:]
    top = max(preds, key=lambda p: p.goodput)
    return Recommendation(
        slo,
        config,
        score[0],
        top.rate,
        rest[0][2] if rest else None,
        rest[0][0][0] if rest else 0.0,
        resolution,
    )
