"""What `omni-pd plan` prints and writes: the fits, a table per SLO pair, the recommendation."""

from __future__ import annotations

from typing import Any, Iterable

from .costs import DECODE_FORM, PREFILL_FORM, StepCosts
from .planner import Prediction, Recommendation, best_per_layout
from .slo import SloPair, fmt_ms

ASSUMPTIONS = (
    "each step runs its prompt chunks as one prefill pass, then its decodes as one decode pass, "
    "one after the other (no overlap between the two passes, nor between steps)",
    "a pass costs what the affine fit of the profile says, also outside the profiled rows",
    "a worker on N cores runs at the N-thread profile's costs; a step that starts while another "
    "worker computes runs --corun-slowdown times slower (default 1,1: no interference, which "
    "two workers sharing a memory bus do not have)",
    "every request generates exactly its drawn output length (the bench's --ignore-eos)",
    "no prefix-cache hits (the bench's prompts share no prefix); the orchestrator, HTTP and "
    "detokenizing add nothing but --hop-ms between the P/D legs and --step-overhead-ms per step",
)


def _ms(value: float | None) -> str:
    return "-" if value is None else fmt_ms(value)


def describe_costs(costs: StepCosts) -> list[str]:
    pa, pb, pc = costs.prefill.coef
    da, db, dc = costs.decode.coef
    return [
        f"{costs.source}: {costs.device}, {costs.threads} thread(s), {costs.layers} layer(s), {costs.dtype}",
        f"  {PREFILL_FORM}: a={pa:.1f} b={pb:.4f} c={pc:.3g}; worst row off by "
        f"{costs.prefill.max_rel_err:.1%} (rows of {costs.prefill.lo}-{costs.prefill.hi} tokens)",
        f"  {DECODE_FORM}: a={da:.1f} b={db:.3f} c={dc:.3g}; worst row off by "
        f"{costs.decode.max_rel_err:.1%} (batches {costs.decode.lo}-{costs.decode.hi})",
    ]


def format_slo_table(predictions: list[Prediction], slo: SloPair, rec: Recommendation) -> str:
    best = best_per_layout(predictions, slo.name)
    chosen = set(best.values())
    rows = [p for p in predictions if p.slo == slo.name and p.config in chosen]
    width = max([len("layout")] + [len(p.config.label) for p in rows])
    lines = [
        f"SLO {slo.describe()}",
        f"{'layout':{width}s}  rate/s  goodput/s  attained  TTFT p50/p99 ms  TPOT p50/p99 ms",
    ]
    for p in rows:
        r = p.row
        attained = r.get("slo_attainment")
        lines.append(
            f"{p.config.label:{width}s}  {p.rate:6.3g}  {p.goodput:9.3f}  "
            f"{'-' if attained is None else f'{attained:7.0%}':>8s}  "
            f"{_ms(r.get('ttft_ms_p50')):>6s} / {_ms(r.get('ttft_ms_p99')):<6s}  "
            f"{_ms(r.get('tpot_ms_p50')):>6s} / {_ms(r.get('tpot_ms_p99')):<6s}"
            + (f"  ({'; '.join(p.notes)})" if p.notes else "")
        )
    lines.extend(_budget_lines(predictions, slo.name))
    lines.append(recommendation_line(rec))
    return "\n".join(lines)


def _budget_lines(predictions: list[Prediction], slo: str) -> Iterable[str]:
    """For each swept layout: goodput at its best rate under each budget."""
    by_layout: dict[str, dict[int, float]] = {}
    for p in predictions:
        if p.slo == slo and p.config.swept:
            budgets = by_layout.setdefault(p.config.layout.label, {})
            budgets[p.config.budget] = max(budgets.get(p.config.budget, 0.0), p.goodput)
    best = best_per_layout(predictions, slo)
    for layout, budgets in by_layout.items():
        pick = best[layout].budget
        parts = [f"{b}{'*' if b == pick else ''} {g:.3f}" for b, g in sorted(budgets.items())]
        yield f"  {layout} by max_num_batched_tokens (goodput/s at its best rate): {', '.join(parts)}"


def recommendation_line(rec: Recommendation) -> str:
    line = (
        f"recommended under {rec.slo}: {rec.config.label} ({rec.goodput:.3f} req/s within the SLOs, "
        f"at {rec.rate:g} req/s offered)"
    )
    if rec.runner_up is not None:
        line += f"; next {rec.runner_up.label} ({rec.runner_up_goodput:.3f} req/s)"
    if not rec.decisive:
        assert rec.runner_up is not None and rec.margin is not None, "a pick without a runner-up is decisive"
        return line + (
            f": {rec.margin:.0%} apart, within the plan's resolution ({rec.resolution:.0%}, "
            "--resolution): too close to call, measure both"
        )
    if rec.runner_up is not None and rec.config.layout.disaggregated != rec.runner_up.layout.disaggregated:
        loser = "P/D" if not rec.config.layout.disaggregated else "colocated"
        line += f": {loser} loses here"
    return line


def plan_json(
    meta: dict[str, Any],
    costs: list[StepCosts],
    slos: list[SloPair],
    predictions: list[Prediction],
    recs: list[Recommendation],
) -> dict[str, Any]:
    return {
        **meta,
        "cost_model": {"prefill": PREFILL_FORM, "decode": DECODE_FORM},
        "profiles": [
            {
                "source": c.source,
                "device": c.device,
                "threads": c.threads,
                "prefill": {
                    "coef": c.prefill.coef,
                    "max_rel_err": c.prefill.max_rel_err,
                    "tokens": [c.prefill.lo, c.prefill.hi],
                },
                "decode": {
                    "coef": c.decode.coef,
                    "max_rel_err": c.decode.max_rel_err,
                    "batches": [c.decode.lo, c.decode.hi],
                },
            }
            for c in costs
        ],
        "slos": [{"name": s.name, "ttft_ms": s.ttft_ms, "itl_ms": s.itl_ms, "basis": s.basis} for s in slos],
        "assumptions": list(ASSUMPTIONS),
        "predictions": [
            {
                "config": p.config.label,
                "layout": p.config.layout.label,
                "max_num_batched_tokens": p.config.budget,
                "threads_per_worker": p.config.threads,
                "request_rate": p.rate,
                "slo": p.slo,
                **p.row,
                "notes": p.notes,
            }
            for p in predictions
        ],
        "recommended": {
            r.slo: {
                "config": r.config.label,
                "layout": r.config.layout.label,
                "goodput_req_per_s": r.goodput,
                "at_request_rate": r.rate,
                "runner_up": r.runner_up.label if r.runner_up else None,
                "runner_up_goodput_req_per_s": r.runner_up_goodput if r.runner_up else None,
                "margin": r.margin,
                "decisive": r.decisive,
            }
            for r in recs
        },
    }


def write_json(path: str, body: dict) -> None:
    """The plan (or the comparison) as JSON (no NaN: a strict reader takes it)."""
    import json
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")
