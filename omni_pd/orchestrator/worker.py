"""A stage worker: builds one stage engine and runs its step loop, fed over a pipe.

The loop takes every message waiting on the pipe (add, abort, control, shutdown), then runs one
engine step if the engine has work, and sends each request's outputs back as they come. It
blocks on the pipe only while the engine is idle, so a busy engine steps back to back and new
requests join between steps.

In a worker process (`runtime.process: true`, the default) the worker ignores SIGINT (Ctrl-C
reaches the whole process group; the orchestrator decides when workers stop), sets the stage's
`runtime.env` before torch computes anything (so `ATEN_CPU_CAPABILITY` there picks the stage's
CPU kernels, checked by name), pins itself to its `runtime.cpus` (cpu_pin.py), sets torch's
thread counts from the stage config, and exits on a Shutdown message, when the pipe closes, or
when its parent is gone, so a killed orchestrator never leaves a worker (nor its Mooncake port)
behind. `serve()` is the same loop for an engine on a thread of the orchestrator's process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

from .. import hops
from ..engines.base import StepOutput
from ..engines.device import to_device
from . import messages as msg
from .cpu_pin import CpuPinError, pin_worker
from .heap import freeze_startup_heap

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.5  # how long an idle worker waits for a message before housekeeping
HOUSEKEEPING_S = 0.5  # how often a busy worker runs engine housekeeping (lease expiry)
HEARTBEAT_S = 0.5  # how often a worker tells the orchestrator it is alive


def apply_threads(num_threads: int, num_interop_threads: int) -> None:
    """torch's intra-op and inter-op pools for this process. Inter-op can only be set before
    torch runs any parallel work, so this runs first thing in the worker."""
    import torch

    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(num_interop_threads)
    except RuntimeError:  # already started (an in-process stage shares the orchestrator's torch)
        log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())


def worker_main(
    stage_config: Any,
    model: str,
    conn,
    log_level: int,
    threads: tuple[int, int],
    tag: str | None = None,
    watch_parent: bool = True,
    exit_process: bool = True,
    environ: dict[str, str] | None = None,
    stdio: Any = None,
) -> None:
    """`tag`: how the log names this worker (stage0, or stage0.r1 for a replica).
    `environ`, `stdio`: the orchestrator's environment, stdout and stderr when it started the
    worker (a worker forked from the preloading server would otherwise have the server's;
    worker_start.py).
    `watch_parent`: exit when the parent process is gone (a local worker; a Ray actor's parent
    is its raylet, and it sees the orchestrator go by its connection closing). `exit_process`:
    end the process when done (a Ray actor's method returns instead)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if stdio is not None:
        stdio.install()
    tag = tag or f"stage{stage_config.stage_id}"
    logging.basicConfig(
        level=log_level,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s",
    )
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(stage_config.runtime.env)  # torch reads ATEN_CPU_CAPABILITY at its first op
    pinned = _pin(stage_config, tag, conn)  # before torch's pool starts: its threads inherit it
    apply_threads(*threads)
    parent = os.getppid()
    engine = _build(stage_config, model, conn, freeze=True) if pinned else None
    if engine is not None:
        serve(engine, conn, alive=(lambda: os.getppid() == parent) if watch_parent else (lambda: True))
    if not exit_process:
        return
    # The engine is closed and the pipe too: skip the interpreter's slow teardown of the model
    # (seconds on a busy machine), which only delays the orchestrator's shutdown.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


def _pin(stage_config: Any, tag: str, conn) -> bool:
    """Pin the worker to its CPUs; False (the orchestrator told why) when its node lacks them."""
    try:
        pin_worker(stage_config, tag)
    except CpuPinError as exc:
        conn.send_bytes(msg.dumps(msg.StartupFailed(stage_config.stage_id, str(exc))))
        conn.close()
        return False
    return True


def _build(stage_config: Any, model: str, conn, freeze: bool = False):
    try:
        from ..engines.hf.compute_identity import ENV, cpu_capability

        wanted = stage_config.runtime.env.get(ENV)
        if wanted is not None and wanted != os.environ.get(ENV):
            raise ValueError(
                f"stage {stage_config.stage_id}: runtime.env sets {ENV}={wanted!r}, but "
                "the stage runs in the orchestrator's process, whose torch has its "
                "own; give the stage runtime.process: true"
            )
        log.info("torch computes with its %s CPU kernels", cpu_capability())  # checks the variable
        from .engine_factory import build_engine

        engine = build_engine(stage_config, model)
    except BaseException as exc:  # report, then exit: the orchestrator raises with this message
        conn.send_bytes(msg.dumps(msg.StartupFailed(stage_config.stage_id, f"{type(exc).__name__}: {exc}")))
        conn.close()
        return None
    if freeze:  # before Ready: the collection takes a few hundred ms that no request should wait
        freeze_startup_heap(f"stage {stage_config.stage_id} worker")
    conn.send_bytes(msg.dumps(msg.Ready(stage_config.stage_id, os.getpid(), engine.describe())))
    return engine


def thread_main(stage_config: Any, model: str, conn) -> None:
    """An in-process stage (`runtime.process: false`): the same loop on a thread."""
    engine = _build(stage_config, model, conn)
    if engine is not None:
        serve(engine, conn, alive=lambda: True)


def _onto(engine, value: Any) -> Any:
    """A request's input on the engine's device (it arrives with host tensors)."""
    return value if engine.device == "cpu" else to_device(value, engine.device)


class _Loop:
    def __init__(self, engine, conn) -> None:
        self.engine = engine
        self.conn = conn
        self.stopping = False
        self._send_lock = threading.Lock()  # the step loop and the heartbeat thread both send
        self.load = engine.load()  # as of the last step, sent with each heartbeat

    def send(self, message: Any) -> None:
        data = msg.dumps(message)
        with self._send_lock:
            self.conn.send_bytes(data)

    def heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            beat = msg.dumps(msg.Heartbeat(self.load))
            try:
                with self._send_lock:
                    self.conn.send_bytes(beat)
            except (OSError, ValueError):  # the pipe is closed: the loop is ending too
                return

    def handle(self, message: Any) -> None:
        engine = self.engine
        if isinstance(message, msg.AddRequest):
            try:
                engine.add_request(
                    message.request_id,
                    _onto(engine, message.prompt),
                    message.params,
                    message.stream,
                    message.chunks,
                    message.chunk_sizes,
                    rows=message.rows,
                )
            except Exception as exc:
                log.debug("request %s refused:\n%s", message.request_id, traceback.format_exc())
                self.send(msg.GenerateFailed(message.request_id, f"{type(exc).__name__}: {exc}"))
        elif isinstance(message, msg.AppendInput):
            try:
                engine.append_input(message.request_id, _onto(engine, message.data), message.final)
            except Exception as exc:  # the request cannot go on: fail it, free what it holds
                log.debug("input for %s refused:\n%s", message.request_id, traceback.format_exc())
                if message.request_id in engine.request_ids():
                    engine.abort_request(message.request_id)
                    self.send(msg.GenerateFailed(message.request_id, f"{type(exc).__name__}: {exc}"))
        elif isinstance(message, msg.Abort):
            engine.abort_request(message.request_id)
        elif isinstance(message, msg.ControlRequest):
            try:
                reply = msg.ControlResult(message.call_id, engine.control(message.name, **message.kwargs))
            except Exception as exc:
                reply = msg.ControlResult(message.call_id, error=f"{type(exc).__name__}: {exc}")
            self.send(reply)
        elif isinstance(message, msg.Shutdown):
            self.stopping = True
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")

    def step(self) -> None:
        try:
            # No autograd anywhere in serving: inference mode skips the version counters and
            # view tracking that no_grad still pays for (~8% of a small decode step).
            with torch.inference_mode():
                outputs = self.engine.step()
        except Exception as exc:  # the engine could not isolate it: every request it holds fails
            log.exception("stage %s: engine step failed", self.engine.stage_id)
            error = f"{type(exc).__name__}: {exc}"
            outputs = []
            for request_id in self.engine.request_ids():
                self.engine.abort_request(request_id)
                outputs.append(StepOutput.failed(request_id, error))
        messages: list[Any] = []
        for out in outputs:
            if out.error is not None:
                messages.append(msg.GenerateFailed(out.request_id, out.error))
                continue
            if out.new_token_ids:
                messages.append(msg.TokenDelta(out.request_id, list(out.new_token_ids)))
            if out.chunk is not None:
                messages.append(msg.ChunkOutput(out.request_id, out.chunk))
            if out.finished:
                if isinstance(getattr(out.output, "metrics", None), dict):
                    hops.stamp(out.output.metrics, "result out")
                messages.append(msg.GenerateResult(out.request_id, out.output))
        if len(messages) == 1:
            self.send(messages[0])
        elif messages:
            self.send(msg.StepMessages(messages))


def serve(engine, conn, alive: Callable[[], bool]) -> None:
    loop = _Loop(engine, conn)
    last_housekeeping = time.monotonic()
    stop_heartbeat = threading.Event()
    threading.Thread(
        target=loop.heartbeat, args=(stop_heartbeat,), name="omni-pd-heartbeat", daemon=True
    ).start()
    try:
        while alive() and not loop.stopping:
            busy = engine.has_unfinished_requests()
            # A busy engine steps back to back, unless every request it holds waits on I/O (a KV
            # read): then it waits a little for messages rather than spin a core.
            wait_s = engine.step_delay_s() if busy else IDLE_POLL_S
            if 0 < wait_s < 0.001:
                # poll() waits in whole milliseconds: a 0.2 ms wait would last 1 ms.
                time.sleep(wait_s)
                wait_s = 0
            try:
                # A wait also ends when the engine's I/O does (its wake fd: a KV receive ended).
                if conn.poll(0) if wait_s == 0 else engine.wait_for_io(wait_s, [conn]):
                    while True:  # everything that is waiting, then one step
                        loop.handle(msg.loads(conn.recv_bytes()))
                        if loop.stopping or not conn.poll(0):
                            break
            except (EOFError, OSError):
                break  # the orchestrator is gone
            if loop.stopping:
                break
            if engine.has_unfinished_requests():
                loop.step()
            loop.load = engine.load()
            now = time.monotonic()
            if not busy or now - last_housekeeping >= HOUSEKEEPING_S:
                engine.housekeeping()
                last_housekeeping = now
    finally:
        stop_heartbeat.set()
        engine.close()
        with loop._send_lock:
            conn.close()
