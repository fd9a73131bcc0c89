"""Rules for `runtime.cpus` (config/cpus.py): in the file, one set per replica, none empty, no
CPU held by two workers, only where a worker process of its own can be pinned; at start, only
CPUs this host lets the orchestrator run on (`check_host_cpus`).

Workers placed by Ray run on nodes the file does not name, so two of them may use the same CPU
numbers on different nodes, and the orchestrator cannot see their node's CPUs: they are left out
of the overlap and host checks, and each worker checks its own set where it starts
(orchestrator/cpu_pin.py) with the same message (`missing_cpus`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import AbstractSet

from omni_pd.config.check_context import CheckContext, stage_key
from omni_pd.config.cpus import CpuSet, format_cpulist
from omni_pd.config.errors import ConfigError, ConfigIssue
from omni_pd.config.schema import PipelineConfig, StageConfig


@dataclass(frozen=True)
class _Worker:
    index: int  # the stage's index in stage_args
    stage: StageConfig
    replica: int | None  # None: the stage's only worker
    cpus: CpuSet

    @property
    def name(self) -> str:
        which = f" replica {self.replica}" if self.replica is not None else ""
        return f"stage {self.stage.stage_id}{which}"

    @property
    def key(self) -> str:
        return stage_key(
            self.index, "runtime.cpus" + (f"[{self.replica}]" if self.replica is not None else "")
        )


def _workers(index: int, stage: StageConfig) -> list[_Worker]:
    sets = stage.runtime.cpus or ()
    many = len(sets) > 1 or stage.runtime.num_replicas > 1
    return [_Worker(index, stage, k if many else None, cpus) for k, cpus in enumerate(sets)]


def _on_ray(stage: StageConfig) -> bool:
    return stage.engine_args.distributed_executor_backend == "ray"


def _lists(sets: tuple[CpuSet, ...]) -> list[str] | str:
    """How an issue shows `runtime.cpus`: a cpulist, or one per replica."""
    return format_cpulist(sets[0]) if len(sets) == 1 else [format_cpulist(s) for s in sets]


def _union(sets: tuple[CpuSet, ...]) -> CpuSet:
    return tuple(sorted({cpu for s in sets for cpu in s}))


def _split_example(sets: tuple[CpuSet, ...], replicas: int) -> str:
    """`runtime.cpus` for `replicas` workers: the CPUs given, shared out evenly where they divide."""
    every = _union(sets)
    if len(every) % replicas == 0:
        share = len(every) // replicas
        parts = [format_cpulist(every[k * share : (k + 1) * share]) for k in range(replicas)]
    else:
        parts = [str(k) for k in range(replicas)]
    return "[" + ", ".join(f'"{p}"' for p in parts) + "]"


def _stage_issues(ctx: CheckContext, index: int, stage: StageConfig) -> list[ConfigIssue]:
    runtime, sets = stage.runtime, stage.runtime.cpus or ()
    key, got = stage_key(index, "runtime.cpus"), _lists(sets)
    issues: list[ConfigIssue] = []
    if len(sets) != runtime.num_replicas:
        replicas = runtime.num_replicas
        issues.append(
            ctx.issue(
                stage,
                key,
                got,
                f"one set per replica, e.g. cpus: {_split_example(sets, replicas)}"
                if replicas > 1
                else f'one set, e.g. cpus: "{format_cpulist(_union(sets))}", or num_replicas: {len(sets)}',
                f"{len(sets)} CPU set{'s' if len(sets) != 1 else ''} for {replicas} "
                f"worker{'s' if replicas != 1 else ''} (num_replicas: {replicas})",
            )
        )
    if not runtime.process:
        issues.append(
            ctx.issue(
                stage,
                key,
                got,
                "runtime.process: true, or remove runtime.cpus",
                "an in-process stage (runtime.process: false) runs on threads of the orchestrator's "
                "process, which cannot be pinned apart from the rest of it",
            )
        )
    tp = stage.engine_args.tensor_parallel_size
    if tp > 1:
        issues.append(
            ctx.issue(
                stage,
                key,
                got,
                "tensor_parallel_size: 1, or remove runtime.cpus",
                f"tensor_parallel_size {tp} runs a process per rank, and runtime.cpus does not share "
                "a worker's set out among them",
            )
        )
    smallest = min(sets, key=len)
    if runtime.num_threads is not None and runtime.num_threads > len(smallest):
        issues.append(
            ctx.issue(
                stage,
                stage_key(index, "runtime.num_threads"),
                runtime.num_threads,
                f"at most {len(smallest)}, or remove it (one thread per CPU of the worker's set)",
                f"{runtime.num_threads} threads on the {len(smallest)} CPU(s) "
                f"{format_cpulist(smallest)} of runtime.cpus: threads beyond a worker's CPUs wait "
                "for each other",
            )
        )
    return issues


def check_cpus(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    local: list[_Worker] = []  # workers on this host, in file order
    for index, stage in ctx.stages:
        if stage.runtime.cpus is None:
            continue
        issues.extend(_stage_issues(ctx, index, stage))
        # Sets that are not one per worker are reported above, not compared as workers'.
        if not _on_ray(stage) and len(stage.runtime.cpus) == stage.runtime.num_replicas:
            local.extend(_workers(index, stage))
    for k, worker in enumerate(local):
        shared = [(other, set(worker.cpus) & set(other.cpus)) for other in local[:k]]
        shared = [(other, cpus) for other, cpus in shared if cpus]
        if not shared:
            continue
        names = "; ".join(f"CPU(s) {format_cpulist(cpus)} with {other.name}" for other, cpus in shared)
        issues.append(
            ctx.issue(
                worker.stage,
                worker.key,
                format_cpulist(worker.cpus),
                "CPUs no other worker is pinned to",
                f"{worker.name} shares {names}: two workers pinned to one CPU take turns on it",
            )
        )
    return issues


def missing_cpus(cpus: CpuSet, available: AbstractSet[int], where: str) -> tuple[str, str] | None:
    """(message, what to change) when `cpus` are not all in `available`, the CPUs of `where`
    ("this host", "node X") a process may run on; None when they are."""
    missing = sorted(set(cpus) - set(available))
    if not missing:
        return None
    return (
        f"CPU(s) {format_cpulist(missing)} are not among the CPUs {where} lets this process run "
        f"on ({format_cpulist(available)}, os.sched_getaffinity)",
        f"CPUs within {format_cpulist(available)}",
    )


def check_host_cpus(config: PipelineConfig, file: str, available: AbstractSet[int] | None = None) -> None:
    """Before any worker starts: raise ConfigError naming each local worker whose CPUs this host
    does not let the orchestrator run on (`available`, default its affinity)."""
    have = os.sched_getaffinity(0) if available is None else available
    issues: list[ConfigIssue] = []
    for index, stage in enumerate(config.stages):
        if _on_ray(stage):
            continue  # its node checks (orchestrator/cpu_pin.py)
        for worker in _workers(index, stage):
            problem = missing_cpus(worker.cpus, have, "this host")
            if problem:
                message, allowed = problem
                issues.append(
                    ConfigIssue(
                        file, stage.stage_id, worker.key, format_cpulist(worker.cpus), allowed, message
                    )
                )
    if issues:
        raise ConfigError(issues)
