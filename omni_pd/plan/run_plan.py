"""`omni-pd plan`'s run: its flags checked (each bad one refused in one line), the costs read or
measured, then the plan or the comparison printed and written."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from .costs import StepCosts, fit_costs
from .errors import PlanError
from .layouts import Layout, threads_per_worker
from .profile import Profile, read_profile
from .simulate import Contention, EngineArgs, Handoff, kv_bytes_per_token
from .workload import Workload, parse_lengths


@dataclass
class CostTable:
    """The fitted costs by thread count (a GPU profile: one entry, for one GPU per worker)."""

    by_threads: dict[int, StepCosts]
    gpu: bool
    speedup: float | None = None

    @property
    def base(self) -> StepCosts:
        """The fewest-thread costs: one core's worker, the SLO multiples' reference."""
        return self.by_threads[min(self.by_threads)]

    def __call__(self, threads: int) -> StepCosts:
        if threads in self.by_threads:
            return self.by_threads[threads]
        if self.gpu:
            raise PlanError(
                f"a worker would span {threads} GPUs: tensor parallelism is not modelled; give "
                "--cpus as many GPUs as the layout has workers"
            )
        if self.speedup is not None:
            return self.base.scaled(self.speedup, threads)
        have = ", ".join(str(t) for t in sorted(self.by_threads))
        raise PlanError(
            f"no profile measured {threads} threads (the profiles have {have}): run `OMP_NUM_THREADS={threads} "
            f"taskset -c 0-{threads - 1} omni-pd bench roofline CKPT ... --json r{threads}.json` and add it to "
            "--profile, or assume a speedup with --thread-speedup S"
        )


def _positive(value: float | int | None, flag: str, minimum: float = 1, what: str = ">= 1") -> None:
    if value is not None and value < minimum:
        raise PlanError(f"{flag} must be {what}, got {value}")


def _ints(text: str, flag: str, minimum: int, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise PlanError(f"{flag} takes whole numbers {what}, comma-separated; got {text!r}")
    return sorted(dict.fromkeys(values))


def rates_of(text: str | None) -> list[float]:
    if not text:
        raise PlanError("--request-rate is needed: the offered rates to predict, req/s, comma-separated")
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        raise PlanError(f"--request-rate takes rates > 0 (req/s), comma-separated; got {text!r}")
    return rates


def check_numbers(args: argparse.Namespace) -> None:
    _positive(args.num_requests, "--num-requests")
    _positive(args.max_num_seqs, "--max-num-seqs")
    _positive(args.kv_blocks, "--kv-blocks")
    _positive(args.block_size, "--block-size")
    _positive(args.cpus, "--cpus")
    _positive(args.template_tokens, "--template-tokens", 0, ">= 0")
    _positive(args.hop_ms, "--hop-ms", 0, ">= 0")
    _positive(args.step_overhead_ms, "--step-overhead-ms", 0, ">= 0")
    contention_of(args)
    if args.thread_speedup is not None and args.thread_speedup <= 0:
        raise PlanError(f"--thread-speedup must be > 0, got {args.thread_speedup}")
    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token <= 0:
        raise PlanError(f"--kv-bytes-per-token must be > 0, got {args.kv_bytes_per_token}")
    if args.resolution is not None and not 0 <= args.resolution < 1:
        raise PlanError(f"--resolution must be a fraction in [0, 1), got {args.resolution}")
    if args.max_num_batched_tokens < args.block_size:
        raise PlanError(
            f"--max-num-batched-tokens {args.max_num_batched_tokens} is smaller than a KV block "
            f"({args.block_size} tokens); give at least {args.block_size}"
        )


def budgets_of(args: argparse.Namespace) -> list[int]:
    if not args.chunk_budgets:
        return []
    budgets = _ints(args.chunk_budgets, "--chunk-budgets", 1, ">= 1")
    if budgets[0] < args.block_size:
        raise PlanError(
            f"--chunk-budgets: {budgets[0]} is smaller than a KV block ({args.block_size} tokens); "
            f"give budgets of at least {args.block_size}"
        )
    return budgets


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(
        parse_lengths(args.prompt_tokens, "--prompt-tokens"),
        parse_lengths(args.output_tokens, "--output-tokens"),
        args.seed,
        args.template_tokens,
    )


def check_fits(workload: Workload, engine: EngineArgs) -> None:
    """A request must fit an engine's KV pool alone (the engine refuses it otherwise)."""
    longest = workload.prompt.hi + workload.template_tokens + workload.output.hi
    needed = -(-longest // engine.block_size)
    if needed > engine.kv_blocks:
        raise PlanError(
            f"--kv-blocks {engine.kv_blocks}: the longest request ({longest} positions) needs {needed} "
            f"blocks of {engine.block_size}; raise --kv-blocks or shorten the lengths"
        )


def cost_table(args: argparse.Namespace, layouts: list[Layout], cpus: int) -> CostTable:
    """The costs the flags name: --profile files, or a profile measured now (--profile-model)."""
    if bool(args.profile) == bool(args.profile_model):
        raise PlanError("give either --profile (bench roofline JSON files) or --profile-model DIR")
    profiles: list[Profile]
    if args.profile:
        profiles = [read_profile(p.strip()) for p in args.profile.split(",") if p.strip()]
    else:
        from .profile_run import profile_model, save_profile

        threads = [cpus // layout.workers for layout in layouts if layout.workers <= cpus]
        profiles = profile_model(args.profile_model, threads or [1], args.device)
        for p in profiles if args.save_profile else []:
            save_profile(p, f"{args.save_profile}/roofline-t{p.threads}.json")
    if len({p.gpu for p in profiles}) > 1:
        raise PlanError("--profile mixes CPU and GPU profiles; plan one kind of worker at a time")
    table: dict[int, StepCosts] = {}
    for profile in profiles:
        key = 1 if profile.gpu else profile.threads
        if key in table:
            raise PlanError(
                f"--profile: {table[key].source} and {profile.source} both measured {key} thread(s)"
            )
        table[key] = fit_costs(profile)
    return CostTable(table, profiles[0].gpu, args.thread_speedup)


def contention_of(args: argparse.Namespace) -> Contention:
    """--corun-slowdown PREFILL,DECODE, each >= 1."""
    parts = args.corun_slowdown.split(",")
    try:
        prefill, decode = (float(x) for x in parts)
    except ValueError:
        raise PlanError(
            f"--corun-slowdown takes two numbers >= 1, PREFILL,DECODE (e.g. 1.2,1.6); got {args.corun_slowdown!r}"
        ) from None
    if not (prefill >= 1 and decode >= 1):
        raise PlanError(
            f"--corun-slowdown factors must be >= 1 (1: no interference); got {args.corun_slowdown!r}"
        )
    return Contention(prefill, decode)


def handoff_of(args: argparse.Namespace, costs: StepCosts) -> Handoff:
    per_token = args.kv_bytes_per_token or kv_bytes_per_token(costs)
    return Handoff(args.hop_ms, per_token, costs.bandwidth)


def cpus_of(args: argparse.Namespace) -> int:
    if args.cpus is not None:
        return args.cpus
    from ..bench.report import cpu_count

    return cpu_count()


def worker_threads(cpus: int) -> Callable[[Layout], int]:
    return lambda layout: threads_per_worker(layout, cpus)


def say(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
