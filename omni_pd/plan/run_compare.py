"""`omni-pd plan --compare`: the bench's measured goodput beside the plan's, row by row."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .compare import bests, compare, format_compare, read_bench, winners
from .errors import PlanError
from .layouts import Layout
from .run_plan import CostTable, contention_of, handoff_of, say
from .simulate import EngineArgs
from .workload import Workload


def compare_map(text: str | None) -> dict[str, str]:
    mapping = {}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        label, sep, layout = part.partition("=")
        if not sep or not label or not layout:
            raise PlanError(f"--compare-map takes LABEL=LAYOUT pairs, comma-separated; got {part!r}")
        mapping[label] = layout
    return mapping


def run_compare(
    args: argparse.Namespace,
    costs: CostTable,
    engine: EngineArgs,
    workload: Workload,
    threads: Callable[[Layout], int],
) -> int:
    mapping = compare_map(args.compare_map)
    measured, skipped = [], []
    for path in (p.strip() for p in args.compare.split(",") if p.strip()):
        rows, left = read_bench(path, mapping, engine, workload)
        measured += rows
        skipped += left
    if not measured:
        raise PlanError(
            f"--compare: no row's label names a layout ({', '.join(skipped)}); map them with --compare-map"
        )
    for m in measured:
        threads(m.layout)  # more workers than --cpus: refused
        if not m.pairs:
            raise PlanError(f"--compare {m.source}: row {m.label} has no num_requests and no requests listed")
    compared = compare(
        measured, handoff_of(args, costs.base), threads, costs, args.step_overhead_ms, contention_of(args)
    )
    say(format_compare(compared, sorted(set(skipped))))
    if args.json_path:
        from .report import write_json

        body = {
            "rows": [
                {
                    "source": c.measured.source,
                    "config": c.measured.label,
                    "layout": c.measured.layout.label,
                    "request_rate": c.measured.rate,
                    "slo_ttft_ms": c.measured.slo.ttft_ms,
                    "slo_itl_ms": c.measured.slo.itl_ms,
                    "measured_goodput_req_per_s": c.measured.goodput,
                    "predicted": c.predicted,
                    "rel_err": c.rel_err,
                }
                for c in compared
            ],
            "best": [
                {
                    "source": b.source,
                    "config": b.label,
                    "measured_goodput_req_per_s": b.measured,
                    "measured_rate": b.measured_rate,
                    "predicted_goodput_req_per_s": b.predicted,
                    "predicted_rate": b.predicted_rate,
                    "rel_err": b.rel_err,
                }
                for b in bests(compared)
            ],
            "winners": {k: {"measured": a, "predicted": b} for k, (a, b) in winners(compared).items()},
            "skipped": sorted(set(skipped)),
        }
        write_json(args.json_path, body)
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0
