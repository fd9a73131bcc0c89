"""SLO pairs, and a simulated level summarised the way the bench summarises a measured one.

A pair is a TTFT bound and an inter-token bound, the latter judged per request on its mean time
per output token after the first (DistServe's TPOT), as `bench.stats.meets_slo` judges it. The
pairs are absolute (`--slo-ttft-ms` / `--slo-itl-ms`) or multiples of the profile's own step
costs (`--slo-pairs`): ITL a multiple of the decode step at batch 8 at the workload's median
context, TTFT a multiple of the prefill of the median prompt. `tight` is ITL <= 1.25x and TTFT
<= 5x, `loose` ITL <= 3x and TTFT <= 2x (tight and loose name the ITL bound, the one P/D protects),
`I:T` any other multiples.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench.stats import summarize_level
from .costs import StepCosts
from .errors import PlanError
from .simulate import SimRun
from .workload import Workload

NAMED = {"tight": (1.25, 5.0), "loose": (3.0, 2.0)}  # (ITL x decode@8, TTFT x median prefill)


@dataclass(frozen=True)
class SloPair:
    name: str
    ttft_ms: float | None  # None: no bound (a bench run that set only the other one)
    itl_ms: float | None
    basis: str = "absolute"  # how the bounds were set

    def describe(self) -> str:
        ttft = "-" if self.ttft_ms is None else f"{fmt_ms(self.ttft_ms)} ms"
        itl = "-" if self.itl_ms is None else f"{fmt_ms(self.itl_ms)} ms"
        return f"{self.name}: TTFT <= {ttft}, ITL (TPOT) <= {itl} ({self.basis})"


def fmt_ms(value: float) -> str:
    """Milliseconds to the nearest one, or three figures below 100."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _positive_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise PlanError(f"{flag} takes milliseconds > 0, comma-separated; got {text!r}")
    return values


def absolute_pairs(ttft: str | None, itl: str | None) -> list[SloPair]:
    """`--slo-ttft-ms` and `--slo-itl-ms`, zipped: pair i is (ttft[i], itl[i])."""
    if ttft is None or itl is None:
        raise PlanError("--slo-ttft-ms and --slo-itl-ms go together (goodput needs both bounds)")
    ttfts, itls = _positive_list(ttft, "--slo-ttft-ms"), _positive_list(itl, "--slo-itl-ms")
    if len(ttfts) != len(itls):
        raise PlanError(
            f"--slo-ttft-ms has {len(ttfts)} values and --slo-itl-ms {len(itls)}; give one per SLO pair"
        )
    return [SloPair(f"slo{i + 1}", t, s) for i, (t, s) in enumerate(zip(ttfts, itls))]


def reference_costs(costs: StepCosts, workload: Workload) -> tuple[float, float]:
    """(decode step at batch 8 at the median context, prefill of the median prompt), in ms."""
    decode8 = costs.decode_ms(8, 8 * workload.median_context)
    prefill = costs.prefill_ms([(workload.median_prompt, 0)])
    return decode8, prefill


def parse_multiples(text: str) -> list[tuple[str, float, float]]:
    """`--slo-pairs`: (name, ITL multiple, TTFT multiple) of tight, loose or I:T."""
    out = []
    for name in (p.strip() for p in text.split(",") if p.strip()):
        if name in NAMED:
            itl_x, ttft_x = NAMED[name]
        else:
            try:
                itl_x, ttft_x = (float(v) for v in name.split(":"))
            except ValueError:
                itl_x = ttft_x = -1.0
            if min(itl_x, ttft_x) <= 0:
                raise PlanError(
                    f"--slo-pairs takes tight, loose or ITL:TTFT multiples > 0 (e.g. 2:3), comma-separated; got {name!r}"
                )
        out.append((name, itl_x, ttft_x))
    if not out:
        raise PlanError(f"--slo-pairs names no pair: {text!r}")
    return out


def multiple_pairs(
    multiples: list[tuple[str, float, float]], costs: StepCosts, workload: Workload
) -> list[SloPair]:
    """The pairs `multiples` make of `costs`' decode step at batch 8 and median prefill."""
    decode8, prefill = reference_costs(costs, workload)
    return [
        SloPair(
            name,
            ttft_x * prefill,
            itl_x * decode8,
            f"{itl_x:g}x decode@8 {fmt_ms(decode8)} ms, {ttft_x:g}x median prefill {fmt_ms(prefill)} ms",
        )
        for name, itl_x, ttft_x in multiples
    ]


def summarize(run: SimRun, slo: SloPair) -> dict:
    """The bench's row for this simulated level: req/s, goodput, TTFT and TPOT percentiles."""
    row = summarize_level(run.records, run.wall_s, slo.ttft_ms, None, slo.itl_ms)
    keep = (
        "num_requests",
        "wall_s",
        "req_per_s",
        "goodput_req_per_s",
        "slo_attainment",
        "ttft_ms_p50",
        "ttft_ms_p99",
        "tpot_ms_p50",
        "tpot_ms_p99",
        "e2e_ms_p50",
    )
    return {k: row.get(k) for k in keep}
