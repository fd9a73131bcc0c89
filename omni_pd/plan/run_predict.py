"""The plan itself: every layout at every rate, a table per SLO pair, the recommendations."""

from __future__ import annotations

import argparse
import datetime
from dataclasses import asdict
import shlex
import sys
from typing import Callable

from .errors import PlanError
from .layouts import Layout
from .planner import RESOLUTION, PlanInputs, configs_for, predict, recommend
from .report import ASSUMPTIONS, describe_costs, format_slo_table, plan_json
from .run_plan import CostTable, contention_of, handoff_of, say
from .simulate import EngineArgs
from .slo import SloPair, absolute_pairs, multiple_pairs, parse_multiples
from .workload import Workload


def slo_pairs(args: argparse.Namespace, costs: CostTable | None, workload: Workload) -> list[SloPair]:
    """Absolute pairs, or multiples of the profile's costs (`costs` None: only check the flags)."""
    if args.slo_ttft_ms is not None or args.slo_itl_ms is not None:
        if args.slo_pairs:
            raise PlanError("give --slo-pairs or --slo-ttft-ms/--slo-itl-ms, not both")
        return absolute_pairs(args.slo_ttft_ms, args.slo_itl_ms)
    multiples = parse_multiples(args.slo_pairs or "tight,loose")
    return multiple_pairs(multiples, costs.base, workload) if costs is not None else []


def run_predict(
    args: argparse.Namespace,
    costs: CostTable,
    engine: EngineArgs,
    workload: Workload,
    layouts: list[Layout],
    budgets: list[int],
    rates: list[float],
    threads: Callable[[Layout], int],
    cpus: int,
) -> int:
    configs = configs_for(layouts, budgets, engine.max_num_batched_tokens, threads)
    used = {c.threads: costs(c.threads) for c in configs}  # refuses a missing thread count now
    slos = slo_pairs(args, costs, workload)
    inputs = PlanInputs(
        workload,
        rates,
        args.num_requests,
        engine,
        handoff_of(args, costs.base),
        slos,
        costs,
        args.step_overhead_ms,
        contention_of(args),
    )
    for c in used.values():
        for line in describe_costs(c):
            say(line)
    say(
        f"workload: prompts {workload.prompt} (+{workload.template_tokens} template), outputs {workload.output}, "
        f"{args.num_requests} requests per rate, seed {workload.seed}; {cpus} {'GPUs' if costs.gpu else 'cores'}"
    )
    predictions = predict(configs, inputs)
    resolution = RESOLUTION if args.resolution is None else args.resolution
    recs = [recommend(predictions, slo.name, resolution) for slo in slos]
    for slo, rec in zip(slos, recs):
        say("")
        say(format_slo_table(predictions, slo, rec))
    say("")
    say("the plan assumes:")
    for line in ASSUMPTIONS:
        say(f"  - {line}")
    if args.json_path:
        from .report import write_json

        meta = {
            "command": shlex.join(["omni-pd", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "workload": {**workload.describe(), "num_requests": args.num_requests},
            "request_rates": rates,
            "cpus": cpus,
            "engine": asdict(engine),
            "handoff": {
                "hop_ms": inputs.handoff.hop_ms,
                "kv_bytes_per_token": inputs.handoff.bytes_per_token,
            },
        }
        write_json(args.json_path, plan_json(meta, list(used.values()), slos, predictions, recs))
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0
