"""Where a stage's workers run: its replicas over its devices, and the worker backend (a local
process or a Ray actor)."""

from __future__ import annotations

from omni_pd.config.check_context import CheckContext, stage_key
from omni_pd.config.errors import ConfigIssue


def check_replicas(ctx: CheckContext) -> list[ConfigIssue]:
    """Replicas share the stage's `runtime.devices` out, tensor_parallel_size each."""
    issues: list[ConfigIssue] = []
    for index, stage in ctx.stages:
        replicas, devices = stage.runtime.num_replicas, stage.runtime.devices
        if replicas == 1 or not devices:
            continue
        tp = stage.engine_args.tensor_parallel_size
        have = len([d for d in devices.split(",") if d.strip()])
        if have < replicas * tp:
            issues.append(
                ctx.issue(
                    stage,
                    stage_key(index, "runtime.num_replicas"),
                    replicas,
                    f"at most {have // tp} with these devices, or list {replicas * tp} devices",
                    f"{replicas} replicas of tensor_parallel_size {tp} need {replicas * tp} devices, "
                    f"but runtime.devices lists {have} ({devices!r})",
                )
            )
    return issues


# How a stage's workers run: a local process ("mp", the default) or a Ray actor ("ray").
WORKER_BACKENDS = ("mp", "ray")


def check_worker_backend(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for index, stage in ctx.stages:
        backend = stage.engine_args.distributed_executor_backend
        # vLLM stages hand the key on to vLLM too (its own executor: uni, mp, ray, ...).
        if stage.engine == "hf" and backend is not None and backend not in WORKER_BACKENDS:
            issues.append(
                ctx.issue(
                    stage,
                    stage_key(index, "engine_args.distributed_executor_backend"),
                    backend,
                    "mp (a local worker process) or ray (a Ray actor)",
                    "omni-pd runs each stage worker as a local process or a Ray actor",
                )
            )
        if backend == "ray" and not stage.runtime.process:
            issues.append(
                ctx.issue(
                    stage,
                    stage_key(index, "runtime.process"),
                    False,
                    "true, or drop the ray backend",
                    "a Ray actor is a process of its own; an in-process stage cannot be one",
                )
            )
        if stage.runtime.ray_resources and backend != "ray":
            issues.append(
                ctx.issue(
                    stage,
                    stage_key(index, "runtime.ray_resources"),
                    dict(stage.runtime.ray_resources),
                    "distributed_executor_backend: ray on this stage, or remove ray_resources",
                    "Ray resources place Ray actors; this stage runs as a local process",
                )
            )
    return issues
