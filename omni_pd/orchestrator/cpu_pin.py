"""A stage worker pins itself to its CPUs (`runtime.cpus`) first thing at start, before torch
starts its thread pool, so every thread it ever makes inherits the set.

The orchestrator checked the set against its own host before any local worker started
(config/cpu_checks.py); a worker Ray placed on another node is checked here, on that node, with
the same message, and refuses to start rather than run on CPUs it was not given (the kernel
would quietly pin it to whatever part of the set the node has).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ..config.cpu_checks import missing_cpus
from ..config.cpus import CpuSet, format_cpulist, worker_cpus

log = logging.getLogger(__name__)


class CpuPinError(ValueError):
    """The worker's node lacks CPUs its set names."""


def _thread_ids() -> list[int]:
    # A Ray actor already runs threads of Ray's own when the worker starts, and
    # sched_setaffinity pins one thread: each of them is pinned too.
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no procfs: the calling thread (pid 0) at least
        return [0]


def pin_worker(stage_config: Any, tag: str) -> CpuSet | None:
    """Pin this process (every thread of it) to the worker's set, said in one INFO line; None
    when the stage sets no cpus. Raises CpuPinError, one line naming the stage and the key,
    when this node lacks some of them."""
    cpus = worker_cpus(stage_config.runtime)
    available = os.sched_getaffinity(0)
    if cpus is None:
        log.info("runs on CPU(s) %s (not pinned: runtime.cpus is unset)", format_cpulist(available))
        return None
    problem = missing_cpus(cpus, available, f"node {socket.gethostname()}")
    if problem is not None:
        message, allowed = problem
        raise CpuPinError(
            f"stage {stage_config.stage_id}: runtime.cpus ({tag}): {message} "
            f"(got {format_cpulist(cpus)!r}); allowed: {allowed}"
        )
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    log.info("pinned to CPU(s) %s (runtime.cpus)", format_cpulist(cpus))
    return cpus
