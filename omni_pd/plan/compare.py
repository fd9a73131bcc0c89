"""`omni-pd plan --compare bench.json`: predicted against measured goodput, per layout and rate.

It reads what `omni-pd bench serve --json` wrote: the SLOs it judged goodput by (`slo_ttft_ms`,
`slo_itl_ms`), its seed and workload (`workload`: prompt_tokens, output_tokens), and its open-loop
rows (`open_loop`: config, request_rate, num_requests, goodput_req_per_s). Where a row lists its
requests with the token counts the server answered (`requests`: prompt_tokens, template
included, and output_tokens), those exact lengths are simulated; else the workload is drawn from
its spec and seed as the bench drew it.

A row's `config` label maps to a layout loosely, case and separators aside: `1P1D`, `2P2D`
(xPyD anywhere in the label), `colocated-2x` / `colocated_2x` (colocated-Nx), a `-2` the bench
adds to a repeated label ignored; `@key=value` suffixes set the engine's `max_num_batched_tokens`,
`max_num_seqs` or `kv_pool_blocks`, other suffixes are named and ignored. A label that names no
layout (a `--configs` file stem) is skipped unless `--compare-map LABEL=LAYOUT` names it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .errors import PlanError
from .layouts import Layout, parse_layout
from .planner import Config
from .simulate import Contention, EngineArgs, Handoff, simulate
from .slo import SloPair, summarize
from .workload import Workload, arrivals, parse_lengths

ENGINE_KEYS = {
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
    "kv_pool_blocks": "kv_blocks",
}


@dataclass
class Measured:
    """One open-loop row of a bench run, mapped to what the planner simulates."""

    source: str
    label: str
    layout: Layout
    engine: EngineArgs
    rate: float
    goodput: float | None
    slo: SloPair
    pairs: list[tuple[int, int]]
    seed: int
    notes: list[str]


def map_label(label: str, mapping: dict[str, str]) -> tuple[Layout | None, dict[str, int], list[str]]:
    """(layout, engine overrides, ignored suffixes) of a bench config label."""
    base, *suffixes = label.split("@")
    if base in mapping:
        layout: Layout | None = parse_layout(mapping[base], "--compare-map")
    else:
        squashed = re.sub(r"[\s_]+", "-", base.strip().lower())
        xpyd = re.search(r"(\d+)p(\d+)d", squashed)
        colocated = re.search(r"colocated-?(\d+)x", squashed)
        layout = (
            parse_layout(f"{xpyd[1]}P{xpyd[2]}D")
            if xpyd
            else parse_layout(f"colocated-{colocated[1]}x")
            if colocated
            else None
        )
    overrides, ignored = {}, []
    for suffix in suffixes:
        key, _, value = suffix.partition("=")
        if key in ENGINE_KEYS and value.isdigit() and int(value) >= 1:
            overrides[ENGINE_KEYS[key]] = int(value)
        else:
            ignored.append(suffix)
    return layout, overrides, ignored


def _slo(meta: dict, source: str) -> SloPair:
    ttft, itl = meta.get("slo_ttft_ms"), meta.get("slo_itl_ms")
    if ttft is None and itl is None:
        raise PlanError(
            f"--compare {source}: the bench run had no --slo-ttft-ms / --slo-itl-ms, so no goodput"
        )
    return SloPair(Path(source).stem, ttft, itl, "the bench run's")


def _pairs(row: dict, workload: Workload | None, count: int) -> list[tuple[int, int]] | None:
    listed = row.get("requests")
    if (
        isinstance(listed, list)
        and listed
        and all(r.get("prompt_tokens") is not None and r.get("output_tokens") is not None for r in listed)
    ):
        return [(int(r["prompt_tokens"]), int(r["output_tokens"])) for r in listed]
    return workload.pairs(count) if workload is not None else None


def read_bench(
    path: str, mapping: dict[str, str], engine: EngineArgs, fallback: Workload
) -> tuple[list[Measured], list[str]]:
    """The open-loop rows of one bench JSON that map to a layout, and the labels skipped."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"--compare {path}: cannot read a bench serve JSON ({exc})") from None
    rows = data.get("open_loop") if isinstance(data, dict) else None
    if not rows:
        raise PlanError(
            f"--compare {path}: no `open_loop` rows; run bench serve with --request-rate and --json"
        )
    slo, seed = _slo(data, path), int(data.get("seed") or 0)
    spec = data.get("workload") or {}
    workload = fallback
    if spec.get("prompt_tokens") and spec.get("output_tokens"):
        workload = Workload(
            parse_lengths(spec["prompt_tokens"], f"{path}: workload.prompt_tokens"),
            parse_lengths(spec["output_tokens"], f"{path}: workload.output_tokens"),
            seed,
            fallback.template_tokens,
        )
    measured, skipped = [], []
    for row in rows:
        layout, overrides, ignored = map_label(str(row.get("config")), mapping)
        if layout is None:
            skipped.append(str(row.get("config")))
            continue
        pairs = _pairs(row, workload, int(row.get("num_requests") or 0))
        notes = [f"suffix {s!r} not modelled" for s in ignored]
        measured.append(
            Measured(
                path,
                str(row["config"]),
                layout,
                replace(engine, **overrides),
                float(row["request_rate"]),
                row.get("goodput_req_per_s"),
                slo,
                pairs or [],
                seed,
                notes,
            )
        )
    return measured, sorted(set(skipped))


@dataclass
class Compared:
    measured: Measured
    predicted: dict  # the simulated row

    @property
    def predicted_goodput(self) -> float:
        return self.predicted.get("goodput_req_per_s") or 0.0

    @property
    def rel_err(self) -> float | None:
        actual = self.measured.goodput
        if actual is None or actual <= 0:
            return None
        return self.predicted_goodput / actual - 1.0


def compare(
    measured: list[Measured],
    handoff: Handoff,
    cpus: Callable[[Layout], int],
    costs_for: Callable,
    overhead_ms: float,
    contention: Contention = Contention(),
) -> list[Compared]:
    out = []
    for m in measured:
        config = Config(m.layout, m.engine.max_num_batched_tokens, cpus(m.layout))
        times = arrivals(m.rate, len(m.pairs), m.seed)
        run = simulate(
            m.layout, costs_for(config.threads), m.engine, handoff, m.pairs, times, overhead_ms, contention
        )
        out.append(Compared(m, summarize(run, m.slo)))
    return out


@dataclass
class Best:
    """One config under one SLO pair (one bench file): its goodput at its best rate, measured
    and predicted, each rate chosen on its own side (how item 5 of the experiment reads a
    layout's goodput; a single rate's goodput swings with the few requests near an SLO)."""

    source: str
    label: str
    measured: float
    measured_rate: float
    predicted: float
    predicted_rate: float

    @property
    def rel_err(self) -> float | None:
        return self.predicted / self.measured - 1.0 if self.measured > 0 else None


def bests(rows: list[Compared]) -> list[Best]:
    out = []
    for source in dict.fromkeys(r.measured.source for r in rows):
        mine = [r for r in rows if r.measured.source == source]
        for label in dict.fromkeys(r.measured.label for r in mine):
            own = [r for r in mine if r.measured.label == label]
            m = max(own, key=lambda r: r.measured.goodput or 0.0)
            p = max(own, key=lambda r: r.predicted_goodput)
            out.append(
                Best(
                    source,
                    label,
                    m.measured.goodput or 0.0,
                    m.measured.rate,
                    p.predicted_goodput,
                    p.measured.rate,
                )
            )
    return out


def winners(rows: list[Compared]) -> dict[str, tuple[str, str]]:
    """Per bench file (one SLO pair): (measured winner, predicted winner), each the label with
    the most goodput at its best rate."""
    out = {}
    for source in dict.fromkeys(r.measured.source for r in rows):
        mine = [b for b in bests(rows) if b.source == source]
        out[source] = (
            max(mine, key=lambda b: b.measured).label,
            max(mine, key=lambda b: b.predicted).label,
        )
    return out


def format_compare(rows: list[Compared], skipped: list[str]) -> str:
    width = max([len("config")] + [len(r.measured.label) for r in rows])
    lines = [f"{'config':{width}s}  rate/s  measured/s  predicted/s  error   (SLO)"]
    for r in rows:
        err = r.rel_err
        lines.append(
            f"{r.measured.label:{width}s}  {r.measured.rate:6.3g}  "
            f"{'-' if r.measured.goodput is None else f'{r.measured.goodput:10.3f}':>10s}  "
            f"{r.predicted_goodput:11.3f}  {'-' if err is None else f'{err:+6.0%}':>6s}   ({r.measured.slo.name})"
            + (f"  {'; '.join(r.measured.notes)}" if r.measured.notes else "")
        )
    errs = [abs(r.rel_err) for r in rows if r.rel_err is not None]
    if errs:
        lines.append(f"largest error {max(errs):.0%} over {len(errs)} rows with measured goodput > 0")
    best = bests(rows)
    lines.append("at each config's best rate (measured rate / predicted rate):")
    for b in best:
        err = b.rel_err
        lines.append(
            f"{b.label:{width}s}  {f'{b.measured_rate:g}/{b.predicted_rate:g}':>9s}  {b.measured:10.3f}  "
            f"{b.predicted:11.3f}  {'-' if err is None else f'{err:+6.0%}':>6s}   ({Path(b.source).stem})"
        )
    best_errs = [abs(b.rel_err) for b in best if b.rel_err is not None]
    if best_errs:
        lines.append(f"largest error at the best rates {max(best_errs):.0%} over {len(best_errs)} configs")
    for source, (actual, guess) in winners(rows).items():
        verdict = "agrees" if actual == guess else "DISAGREES"
        lines.append(f"{Path(source).name}: measured winner {actual}, predicted {guess}: {verdict}")
    if skipped:
        lines.append(
            f"skipped (no layout in the label; map it with --compare-map LABEL=LAYOUT): {', '.join(skipped)}"
        )
    return "\n".join(lines)
