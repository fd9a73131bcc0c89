"""torch thread counts per stage worker.

Several worker processes share the machine's cores. Each one running torch's default pool (one
thread per core) oversubscribes it as soon as two stages are busy: idle OpenMP threads spin and
the workers slow each other down (measured: 8 concurrent requests got 0.98 req/s with default
pools, 3.38 with one thread each, on 2 cores). So each worker takes `runtime.num_threads` when the
YAML sets it, one thread per CPU of its set when `runtime.cpus` pins it (`worker_threads`), and
otherwise an equal share of the cores this process may use, at least one.

The orchestrator's own process does only small elementwise work (audio to pcm16, merging
embeddings) between stage steps. With its default pool, each such op on more than torch's grain
of elements forks onto a second core that the busy workers hold, and waits for it: measured at
concurrency 16, the server process spent 56 ms of CPU per request with the default pool and 21 ms
with one thread. So while every stage runs in a worker process, the orchestrator runs torch on one
thread (`orchestrator_threads`).
"""

from __future__ import annotations

import os
from typing import Iterable

from ..config.cpus import worker_cpus


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def stage_threads(stages: Iterable, cores: int | None = None) -> dict[int, tuple[int, int]]:
    """(intra-op, inter-op) threads per stage id (each replica of a stage is a worker)."""
    stages = list(stages)
    cores = cores or usable_cores()
    workers = sum(s.runtime.num_replicas for s in stages if s.runtime.process) or 1
    share = max(1, cores // workers)
    return {s.stage_id: (s.runtime.num_threads or share, s.runtime.num_interop_threads or 1) for s in stages}


def worker_threads(worker_config, stage_default: tuple[int, int]) -> tuple[int, int]:
    """(intra-op, inter-op) threads of one worker (a replica's config holds its own CPUs):
    one intra-op thread per CPU it is pinned to, unless the YAML sets num_threads."""
    cpus = worker_cpus(worker_config.runtime)
    if cpus is None or worker_config.runtime.num_threads is not None:
        return stage_default
    return len(cpus), stage_default[1]


def orchestrator_threads(stages: Iterable) -> int | None:
    """torch intra-op threads for the orchestrator's process: 1 when every stage runs in a worker
    process; None (leave torch's setting) when a stage computes in the orchestrator's process."""
    return 1 if all(s.runtime.process for s in stages) else None
