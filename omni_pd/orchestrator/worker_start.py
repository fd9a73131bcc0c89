"""How stage worker processes start: forked from a server that has imported torch and the models.

A spawned worker imports torch, transformers and its model's code before it can build an engine:
about 6 s of CPU each on the 2-core CI machine, four workers per pipeline, again at every restart.
multiprocessing's forkserver imports those modules once, in a server process that starts clean
(it is spawned, never touches CUDA or threads, and holds no state of the orchestrator), and forks
each worker from it: a worker then starts in a fraction of a second, and a killed one is back
sooner. What the server preloads is generic (this package's worker module) plus what each
registered model names (`ModelSpec.worker_preload`).

Three things differ from spawning, and the worker undoes them: it inherits the environment and
the stdout/stderr the server started with, so the orchestrator passes its environment and its
current stdout and stderr (`ParentStdio`, duplicated into the worker as multiprocessing passes a
pipe) when the worker starts (`worker_main(environ=..., stdio=...)`); and its parent is the
server, which exits when the orchestrator does, so a worker still sees its orchestrator go.

The server's imports take seconds (about 5 s on 2 cores), so the orchestrator starts it as soon as
its stage config has loaded (`start_server_early`): the server imports while the orchestrator
loads its own side of the model, and the first worker forks from a ready server.

`OMNI_PD_WORKER_START=spawn` starts workers the old way (a platform without forkserver, or to
rule it out when debugging).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
from typing import TYPE_CHECKING

from .. import registry

if TYPE_CHECKING:  # ForkServerContext exists on POSIX only
    from multiprocessing.context import ForkServerContext, SpawnContext

    # The contexts of METHODS: their Process classes are what stage workers run as.
    WorkerContext = ForkServerContext | SpawnContext

log = logging.getLogger(__name__)
ENV = "OMNI_PD_WORKER_START"
METHODS = ("forkserver", "spawn")

_lock = threading.Lock()
_context: WorkerContext | None = None


def preload_modules() -> list[str]:
    return ["omni_pd.orchestrator.worker", *registry.worker_preload()]


def worker_context() -> WorkerContext:
    """The multiprocessing context stage workers start from (made once per process)."""
    global _context
    with _lock:
        if _context is None:
            method = os.environ.get(ENV, "forkserver")
            if method not in METHODS:
                raise ValueError(f"{ENV}={method!r}: use one of {', '.join(METHODS)}")
            if method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
                raise ValueError(f"this platform has no forkserver start method: set {ENV}=spawn")
            context: WorkerContext = (
                mp.get_context("forkserver") if method == "forkserver" else mp.get_context("spawn")
            )
            if method == "forkserver":
                modules = preload_modules()
                context.set_forkserver_preload(modules)
                log.debug("stage workers fork from a server that preloads %s", ", ".join(modules))
            _context = context
        return _context


def start_server_early() -> int | None:
    """Start the forkserver now, so that its preloading overlaps the caller's own start-up
    (without this, it starts at the first worker and that worker waits for the imports). The
    server's pid where this call started it; None where workers spawn, and where a server was
    already up."""
    context = worker_context()
    if context.get_start_method() != "forkserver":
        return None
    from multiprocessing import forkserver

    # multiprocessing keeps one server per process; its pid is not public API, read with care.
    server = forkserver._forkserver
    before = getattr(server, "_forkserver_pid", None)
    forkserver.ensure_running()
    after = getattr(server, "_forkserver_pid", None)
    return after if after != before else None


def stop_early_server(pid: int) -> None:
    """Stop the server that `start_server_early` started, for a start-up that failed: it would go
    on importing for seconds after the failure, holding the caller's stdout and stderr open (a
    pipe reading them waits for it). multiprocessing starts another when a worker next needs one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) != pid or not hasattr(server, "_stop"):
        return  # another server by now, or a Python whose forkserver has no _stop: leave it
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()  # reaps it and forgets it


class ParentStdio:
    """The orchestrator's stdout and stderr as they are when a worker starts, for the worker to
    write to (a worker forked from the server would otherwise write where the server's went).
    Pickled as file descriptors, the way multiprocessing passes a Connection."""

    def __init__(self, fds: tuple[int, int] | None = None):
        self.fds = fds if fds is not None else (1, 2)

    def __reduce__(self):
        from multiprocessing import reduction

        return _rebuild_stdio, tuple(reduction.DupFd(fd) for fd in self.fds)

    def install(self) -> None:
        """In the worker: make fds 1 and 2 these."""
        for target, fd in zip((1, 2), self.fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _rebuild_stdio(*dup_fds) -> ParentStdio:
    return ParentStdio(tuple(d.detach() for d in dup_fds))
