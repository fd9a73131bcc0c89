"""`omni-pd plan`: predict each layout's goodput from measured step costs, and pick one.

    omni-pd plan --profile r1.json,r2.json --prompt-tokens uniform:256:1024 \\
        --output-tokens uniform:16:64 --request-rate 0.1,0.2,0.3,0.4 --slo-pairs tight,loose \\
        --layouts 1P1D,colocated-2x,colocated-1x --cpus 2 --chunk-budgets 256,512,1024,2048
    omni-pd plan --profile r1.json,r2.json --compare bench.json

Costs: costs.py (the forms and the fit); the simulation: simulate.py and engine_sim.py; the
SLOs: slo.py; what it assumes: report.ASSUMPTIONS and docs/planner.md.
"""

from __future__ import annotations

import argparse
import sys

from .errors import PlanError

DEFAULT_LAYOUTS = "1P1D,colocated-2x,colocated-1x"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _cost_arguments(parser.add_argument_group("step costs"))
    _workload_arguments(parser.add_argument_group("workload"))
    _slo_arguments(parser.add_argument_group("SLOs"))
    _layout_arguments(parser.add_argument_group("layouts and engines"))
    _output_arguments(parser.add_argument_group("output"))


def _cost_arguments(src: argparse._ArgumentGroup) -> None:
    src.add_argument(
        "--profile",
        default=None,
        metavar="JSON[,JSON]",
        help="`bench roofline --json` files, one per thread count (or one GPU's)",
    )
    src.add_argument(
        "--profile-model",
        default=None,
        metavar="DIR",
        help="profile this checkpoint here first (about a minute per thread count at real shapes)",
    )
    src.add_argument(
        "--save-profile",
        default=None,
        metavar="DIR",
        help="with --profile-model: write each thread count's profile there as roofline JSON",
    )
    src.add_argument("--device", default="cpu", help="with --profile-model: cpu or cuda:N")
    src.add_argument(
        "--thread-speedup",
        type=float,
        default=None,
        metavar="S",
        help="where no profile has a worker's threads: the fewest-thread profile's costs / S",
    )


def _workload_arguments(work: argparse._ArgumentGroup) -> None:
    work.add_argument(
        "--prompt-tokens",
        metavar="N|uniform:LO:HI",
        default="uniform:256:1024",
        help="N or uniform:LO:HI, the user message (bench serve's flag)",
    )
    work.add_argument(
        "--output-tokens",
        metavar="N|uniform:LO:HI",
        default="uniform:16:64",
        help="N or uniform:LO:HI, generated tokens per request",
    )
    work.add_argument(
        "--template-tokens",
        metavar="N",
        type=int,
        default=8,
        help="the chat template's tokens around the message (8: Qwen3-Omni's)",
    )
    work.add_argument(
        "--request-rate",
        metavar="R[,R...]",
        default=None,
        help="comma-separated offered rates, req/s (Poisson)",
    )
    work.add_argument(
        "--num-requests",
        metavar="N",
        type=int,
        default=32,
        help="requests per rate (bench serve's --open-loop-requests; default 32)",
    )
    work.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="seed of the arrivals and lengths (bench serve's --seed)",
    )


def _slo_arguments(slo: argparse._ArgumentGroup) -> None:
    slo.add_argument(
        "--slo-ttft-ms", metavar="MS[,MS...]", default=None, help="TTFT bounds, comma-separated, one per pair"
    )
    slo.add_argument(
        "--slo-itl-ms",
        metavar="MS[,MS...]",
        default=None,
        help="mean time per output token (TPOT) bounds, one per pair",
    )
    slo.add_argument(
        "--slo-pairs",
        metavar="PAIR[,PAIR...]",
        default=None,
        help="tight, loose or ITL:TTFT multiples of the profile's decode@8 and median prefill (default tight,loose)",
    )


def _layout_arguments(lay: argparse._ArgumentGroup) -> None:
    lay.add_argument(
        "--layouts",
        metavar="LAYOUT[,...]",
        default=DEFAULT_LAYOUTS,
        help=f"xPyD and colocated-Nx, comma-separated (default {DEFAULT_LAYOUTS})",
    )
    lay.add_argument(
        "--cpus",
        metavar="N",
        type=int,
        default=None,
        help="cores in all, shared equally by a layout's workers (GPUs with a GPU profile; default: this host's)",
    )
    lay.add_argument(
        "--chunk-budgets",
        metavar="N[,N...]",
        default=None,
        help="colocated max_num_batched_tokens to sweep, comma-separated; the best is reported",
    )
    lay.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        type=int,
        default=8192,
        help="the P/D legs' token budget (and colocated's without a sweep; default 8192)",
    )
    lay.add_argument(
        "--max-num-seqs",
        metavar="N",
        type=int,
        default=64,
        help="requests an engine holds at once (default 64)",
    )
    lay.add_argument(
        "--kv-blocks",
        metavar="N",
        type=int,
        default=1024,
        help="each engine's KV pool, blocks (kv_pool_blocks; default 1024)",
    )
    lay.add_argument(
        "--block-size", metavar="N", type=int, default=16, help="KV block size, tokens (default 16)"
    )
    lay.add_argument(
        "--hop-ms",
        metavar="MS",
        type=float,
        default=2.0,
        help="P/D: the orchestrator's relay from prefill leg to decode leg (default 2)",
    )
    lay.add_argument(
        "--step-overhead-ms",
        metavar="MS",
        type=float,
        default=0.0,
        help="added to every engine step (default 0)",
    )
    lay.add_argument(
        "--corun-slowdown",
        metavar="PREFILL,DECODE",
        default="1,1",
        help="how much slower a prefill pass and a decode pass run while another worker on the "
        "host computes (each >= 1; default 1,1: no interference). Measure it: a pinned `bench "
        "roofline` with the other core busy, against the same run on a quiet host (docs/planner.md)",
    )
    lay.add_argument(
        "--kv-bytes-per-token",
        metavar="BYTES",
        type=float,
        default=None,
        help="P/D KV copy size (default: Qwen3-Omni's thinker at the profile's layers and dtype)",
    )


def _output_arguments(out: argparse._ArgumentGroup) -> None:
    out.add_argument(
        "--compare",
        default=None,
        metavar="JSON[,JSON]",
        help="bench serve --json results: predicted against measured goodput",
    )
    out.add_argument(
        "--compare-map",
        default=None,
        metavar="LABEL=LAYOUT[,...]",
        help="layouts of bench labels that name none",
    )
    out.add_argument(
        "--resolution",
        type=float,
        default=None,
        metavar="FRACTION",
        help="a pick predicted less than this far ahead of the next layout is called too close "
        "to call (default 0.2: the plan's largest per-layout error against a measured run)",
    )
    out.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="write the plan (or the comparison) as JSON",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return run_checked(args)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run_checked(args: argparse.Namespace) -> int:
    """Every input checked before any profile runs, then the plan or the comparison. (Imported
    here: `omni-pd`'s parser adds this command's flags on every start.)"""
    from .layouts import parse_layouts
    from .run_compare import run_compare
    from .run_plan import (
        budgets_of,
        check_fits,
        check_numbers,
        cost_table,
        cpus_of,
        rates_of,
        worker_threads,
        workload_of,
    )
    from .run_predict import run_predict, slo_pairs
    from .simulate import EngineArgs

    check_numbers(args)
    layouts = parse_layouts(args.layouts)
    cpus = cpus_of(args)
    threads = worker_threads(cpus)
    for layout in layouts:
        threads(layout)  # more workers than cores: refused before any profile runs
    workload = workload_of(args)
    budgets = budgets_of(args)
    engine = EngineArgs(args.max_num_seqs, args.max_num_batched_tokens, args.kv_blocks, args.block_size)
    check_fits(workload, engine)
    if args.compare:
        return run_compare(args, cost_table(args, layouts, cpus), engine, workload, threads)
    rates = rates_of(args.request_rate)
    slo_pairs(args, None, workload)  # a bad SLO refused before any profile runs
    costs = cost_table(args, layouts, cpus)
    return run_predict(args, costs, engine, workload, layouts, budgets, rates, threads, cpus)
