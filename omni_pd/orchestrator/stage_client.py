"""The orchestrator's handle on one stage worker: many requests in flight over one pipe.

A reader thread takes every message the worker sends and hands it to whoever waits for it: a
request's token deltas and final answer go to that request's asyncio future (on the event loop
that submitted it), a control call's answer to its call id. Sends from any thread are serialised.

When the worker dies, every waiter fails at once with a message naming the stage and the cause
(exit code or signal), and the client starts a new worker after a doubling backoff
(`RestartPolicy`); a worker that died too often is left down. Each worker sends a heartbeat, so
a frozen one (SIGSTOP) shows as unresponsive although its process lives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..sampling import SamplingParams
from . import messages as msg
from .supervisor import RestartPolicy, StageStatus
from .worker import thread_main, worker_main
from .worker_start import ParentStdio, worker_context

log = logging.getLogger(__name__)
# How long a send that found the pipe broken waits for the worker's exit, to name its cause.
SEND_EXIT_WAIT_S = 0.5
POLL_S = 0.2  # how often the reader checks that the worker is still alive


class StageError(RuntimeError):
    """A stage failed a request, died, or missed its deadline; the message names the stage."""


class StageTimeout(StageError):
    pass


class StageUnavailable(StageError):
    """The stage is restarting or down: nothing was sent to it. `retry_after_s` is a hint for
    clients (None when the stage is down for good)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _failure_kind(message: str) -> str:
    """The exception class name a worker put in front of a failure ("KVMissError: ...")."""
    head = message.split(":", 1)[0]
    return head if head.isidentifier() else ""


@dataclass
class _Worker:
    """One incarnation of the stage's worker: a new one after each restart."""

    conn: Any
    process: Any = None  # multiprocessing.Process, or None for an in-process engine thread
    thread: threading.Thread | None = None
    pid: int | None = None


@dataclass
class _Waiter:
    """One request's outputs, delivered on the event loop that submitted it."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    on_tokens: Callable[[list[int]], None] | None
    on_chunk: Callable[[Any], None] | None = None

    def deliver(self, message: Any) -> None:  # on the event loop
        if self.future.done():
            return
        if isinstance(message, (msg.TokenDelta, msg.ChunkOutput)):
            try:
                if isinstance(message, msg.TokenDelta):
                    if self.on_tokens is not None:
                        self.on_tokens(message.token_ids)
                elif self.on_chunk is not None:
                    self.on_chunk(message.data)
            except Exception as exc:  # noqa: BLE001 - the consumer failed: so does the request
                self.future.set_exception(exc)
        elif isinstance(message, msg.GenerateResult):
            self.future.set_result(message.output)
        elif isinstance(message, StageError):
            self.future.set_exception(message)


def _wake(future: asyncio.Future) -> None:  # on the event loop
    if not future.done():
        future.set_result(None)


def _deliver_all(deliveries: list[tuple[_Waiter, Any]]) -> None:  # on the event loop
    for waiter, message in deliveries:
        waiter.deliver(message)


class StageClient:
    def __init__(
        self,
        stage_config: Any,
        model: str,
        startup_timeout_s: float,
        threads: tuple[int, int] = (1, 1),
        replica: int | None = None,
    ):
        """`replica`: this worker's index among its stage's replicas (None: the stage has one)."""
        self.stage_config = stage_config
        self.model = model
        self.stage_id = stage_config.stage_id
        self.model_stage = stage_config.model_stage
        self.replica = replica
        self.engine_load: dict[str, int] = {}  # the worker's last report (`StageEngine.load`)
        self.startup_timeout_s = startup_timeout_s
        self.threads = threads
        self.heartbeat_timeout_s = stage_config.runtime.heartbeat_timeout_s
        self.policy = RestartPolicy.of(stage_config.runtime)
        self.info: dict[str, Any] = {}
        self.status = StageStatus.STARTING
        self.reason = ""  # why the stage is restarting or down
        self.restarts = 0
        self.last_seen = time.monotonic()  # the worker's last message (heartbeats included)
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # guards sends, _waiters, _calls, _dead, status, _worker
        self._waiters: dict[str, _Waiter] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._dead: StageError | None = None
        self._closing = False
        self._stop = threading.Event()  # set at close: a pending restart gives up
        self._status_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # Reaping the worker (join, exitcode) from two threads at once races in waitpid: the
        # loser sees "no such child" and takes a dead worker for alive. One lock for all reaping.
        self._reap_lock = threading.Lock()
        self._worker = self._spawn()

    @property
    def name(self) -> str:
        which = f" replica {self.replica}" if self.replica is not None else ""
        return f"stage {self.stage_id} ({self.model_stage}){which}"

    @property
    def tag(self) -> str:
        """A short name for threads, processes and log lines: stage0, or stage0.r1."""
        return f"stage{self.stage_id}" + (f".r{self.replica}" if self.replica is not None else "")

    @property
    def process(self):
        """The current worker process (None for an in-process stage)."""
        return self._worker.process

    def _spawn(self) -> _Worker:
        name = f"omni-pd-{self.tag}-{self.model_stage}"
        if self.stage_config.engine_args.distributed_executor_backend == "ray":
            from .ray_workers import RayProcess  # it connects back once its actor runs

            ray_process = RayProcess(
                self.stage_config,
                self.model,
                logging.getLogger().getEffectiveLevel(),
                self.threads,
                self.tag,
                self.startup_timeout_s,
            )
            return _Worker(None, process=ray_process, pid=ray_process.pid)
        if self.stage_config.runtime.process:
            context = worker_context()
            conn, child = context.Pipe(duplex=True)
            args = self.stage_config.engine_args
            process = context.Process(
                target=worker_main,
                name=name,
                # A vLLM engine with tensor_parallel_size > 1 starts a process per rank, which
                # a daemonic process may not do; such a worker is closed (and killed) by close()
                # like any other, and vLLM's rank processes exit with their parent.
                daemon=not (args.engine == "vllm" and args.tensor_parallel_size > 1),
                args=(
                    self.stage_config,
                    self.model,
                    child,
                    logging.getLogger().getEffectiveLevel(),
                    self.threads,
                    self.tag,
                ),
                kwargs={"environ": dict(os.environ), "stdio": ParentStdio()},
            )
            process.start()
            child.close()
            return _Worker(conn, process=process, pid=process.pid)
        # the engine on a thread of this process, behind the same pipe protocol
        conn, child = mp.Pipe(duplex=True)
        thread = threading.Thread(
            target=thread_main, name=name, daemon=True, args=(self.stage_config, self.model, child)
        )
        thread.start()
        return _Worker(conn, thread=thread)

    @staticmethod
    def _is_actor(worker: _Worker) -> bool:
        return worker.process is not None and not isinstance(worker.process, mp.process.BaseProcess)

    def _alive(self, worker: _Worker) -> bool:
        if isinstance(worker.process, mp.process.BaseProcess):
            # the sentinel says so without reaping the process
            return not multiprocessing.connection.wait([worker.process.sentinel], 0)
        if worker.process is not None:  # a Ray actor
            return worker.process.is_alive()
        assert worker.thread is not None, "a worker is a process, a Ray actor or a thread"
        return worker.thread.is_alive()

    def alive(self) -> bool:
        return self._alive(self._worker)

    def responsive(self) -> bool:
        """Up, and heard from within the heartbeat timeout (a frozen worker is alive but silent)."""
        return self.status is StageStatus.UP and time.monotonic() - self.last_seen < self.heartbeat_timeout_s

    def _cause(self, worker: _Worker) -> str:
        if worker.process is None:
            return "its in-process engine thread stopped"
        if hasattr(worker.process, "describe_exit"):  # a Ray actor
            return worker.process.describe_exit()
        with self._reap_lock:
            worker.process.join(1.0)
            code = worker.process.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return f"its worker (pid {worker.pid}) {how}"

    # ---- start-up ----------------------------------------------------------------------------
    def _await_ready(self, worker: _Worker) -> dict[str, Any]:
        deadline = time.monotonic() + self.startup_timeout_s
        if worker.conn is None:  # a Ray actor connects back first
            from .ray_workers import wait_connected

            worker.conn = wait_connected(worker.process, deadline, POLL_S)
            if worker.conn is None:
                if not self._alive(worker):
                    raise StageError(
                        f"{self.name}: {self._cause(worker)} while starting; its log above says why"
                    )
                raise StageTimeout(
                    f"{self.name}'s Ray actor did not connect back within "
                    f"{self.startup_timeout_s:.0f} s; check that its node can reach "
                    "this one"
                )
        while True:
            try:
                if worker.conn.poll(POLL_S):
                    reply = msg.loads(worker.conn.recv_bytes())
                    break
            except (EOFError, OSError):
                pass
            if not self._alive(worker):
                raise StageError(f"{self.name}: {self._cause(worker)} while starting; its log above says why")
            if time.monotonic() > deadline:
                raise StageTimeout(f"{self.name} did not start within {self.startup_timeout_s:.0f} s")
        if isinstance(reply, msg.StartupFailed):
            raise StageError(f"{self.name} failed to start: {reply.message}")
        where = f"worker pid {reply.pid}" if worker.process is not None else "this process"
        log.info("%s ready in %s (%d intra-op / %d inter-op threads)", self.name, where, *self.threads)
        return reply.info

    def wait_ready(self) -> None:
        self.info = self._await_ready(self._worker)
        self._set_up()

    def _set_up(self) -> None:
        with self._lock:
            self._dead = None
            self.status, self.reason = StageStatus.UP, ""
            self.last_seen = time.monotonic()
            worker = self._worker
        threading.Thread(
            target=self._read, args=(worker,), daemon=True, name=f"omni-pd-{self.tag}-reader"
        ).start()
        self._notify()

    # ---- availability --------------------------------------------------------------------------
    def _notify(self) -> None:
        """Wake whoever waits for this stage's status to change."""
        with self._lock:
            waiters, self._status_waiters = self._status_waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that event loop is closed
                pass

    def unavailable(self) -> StageUnavailable | None:
        """Why a request cannot be sent now, or None when the stage is up and responsive. Reads
        plain attributes only, so it may run under `_lock`."""
        if self.status is StageStatus.UP:
            if not self._alive(self._worker):  # dead, and the reader is about to say so
                return StageUnavailable(
                    f"{self.name}'s worker has just exited; it is restarted unless it died too often", 1.0
                )
            silent = time.monotonic() - self.last_seen
            if silent < self.heartbeat_timeout_s:
                return None
            return StageUnavailable(
                f"{self.name} has not answered for {silent:.1f} s (frozen or "
                "starved of CPU); its requests wait",
                self.heartbeat_timeout_s,
            )
        if self.status is StageStatus.RESTARTING:
            return StageUnavailable(
                f"{self.name} is restarting ({self.reason}); retry shortly",
                max(1.0, self.policy.first_backoff_s * 4),
            )
        if self.status is StageStatus.DOWN:
            return StageUnavailable(
                f"{self.name} is down: {self.reason}; restart the server once the cause is fixed"
            )
        if self.status is StageStatus.CLOSED:
            return StageUnavailable(f"{self.name} stopped at shutdown")
        return StageUnavailable(f"{self.name} is still starting")

    async def wait_usable(self, timeout_s: float) -> None:
        """Return once the stage is up and responsive; wait while it restarts or is silent (up
        to `timeout_s`, then StageTimeout); raise StageUnavailable at once when it is down."""
        deadline = time.monotonic() + timeout_s
        while True:
            why = self.unavailable()
            if why is None:
                return
            if self.status in (StageStatus.DOWN, StageStatus.CLOSED):
                raise why
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StageTimeout(f"{why} (gave up waiting after {timeout_s:.1f} s, the request's deadline)")
            # A silent worker that speaks again does not notify: look again every half second.
            try:
                await asyncio.wait_for(self.status_changed(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass

    def status_changed(self) -> asyncio.Future:
        """A future (on the running event loop) set when the stage's status next changes."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            # Drop waits given up on (timed out), so a long outage does not grow the list.
            self._status_waiters = [(loop, f) for loop, f in self._status_waiters if not f.done()]
            self._status_waiters.append((loop, future))
        return future

    # ---- the reader thread -------------------------------------------------------------------
    def _read(self, worker: _Worker) -> None:
        silent = False  # reported silent (frozen) and not heard from since
        while True:
            try:
                if worker.conn.poll(POLL_S):
                    data = worker.conn.recv_bytes()
                    self.last_seen = time.monotonic()
                    if silent:
                        silent = False
                        log.info("%s answers again", self.name)
                        self._notify()
                    self._dispatch(msg.loads(data))
                    continue
            except (EOFError, OSError):
                pass
            else:
                if self._alive(worker):
                    quiet = time.monotonic() - self.last_seen
                    if not silent and quiet >= self.heartbeat_timeout_s:
                        silent = True
                        log.warning(
                            "%s has sent nothing, not even its heartbeat, for %.1f s: "
                            "frozen (SIGSTOP?) or starved of CPU; its requests wait",
                            self.name,
                            quiet,
                        )
                    continue
            # The pipe closed or the worker is gone: fail whoever still waits.
            if self._closing:
                self._fail_all(StageError(f"{self.name} stopped at shutdown"))
            else:
                self._died(worker)
            return

    def _died(self, worker: _Worker) -> None:
        cause = self._cause(worker)
        delay = self.policy.next_delay(time.monotonic())
        if delay is None:
            fate = f"it is left down ({self.policy.describe_limit()})"
            status = StageStatus.DOWN
            log.warning(
                "%s: %s; %s; /health reports it until the server is restarted", self.name, cause, fate
            )
        else:
            fate = f"it is being restarted (restart {self.restarts + 1}, in {delay:.2f} s)"
            status = StageStatus.RESTARTING
            log.warning("%s: %s; restarting it in %.2f s", self.name, cause, delay)
        error = StageError(f"{self.name}: {cause} while requests were in flight; {fate}")
        with self._lock:
            self.status = status
            self.reason = cause if delay is not None else f"{cause} ({self.policy.describe_limit()})"
        self._fail_all(error)
        self._notify()
        if delay is not None:
            threading.Thread(
                target=self._restart_after, args=(delay,), daemon=True, name=f"omni-pd-{self.tag}-restart"
            ).start()

    def _restart_after(self, delay: float) -> None:
        if self._stop.wait(delay):
            return  # closing
        old = self._worker
        if old.process is not None:
            with self._reap_lock:
                old.process.join(1.0)
            if self._is_actor(old):
                old.process.kill()  # the actor may outlive its worker loop
        if old.conn is not None:
            old.conn.close()
        began = time.monotonic()
        try:
            worker = self._spawn()
        except Exception as exc:  # noqa: BLE001 - e.g. no Ray node offers what it asks for
            log.warning("%s: restart failed: %s", self.name, exc)
            with self._lock:
                self.status, self.reason = StageStatus.DOWN, f"restart failed: {exc}"
            self._notify()
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self._worker = worker
        if closing:
            self._stop_worker(worker)
            return
        try:
            info = self._await_ready(worker)
        except StageError as exc:
            log.warning("%s: restart failed: %s", self.name, exc)
            self._stop_worker(worker)  # one that hangs in start-up must not linger
            self._died(worker)
            return
        with self._lock:
            closing = self._closing
        if closing:  # close() came while it started: it stops with the others
            return
        self.info = info
        self.restarts += 1
        self._set_up()
        log.info(
            "%s is back after a restart (%d so far) in %.1f s",
            self.name,
            self.restarts,
            time.monotonic() - began,
        )

    def _stop_worker(self, worker: _Worker) -> None:
        if self._is_actor(worker):
            worker.process.kill()
        elif worker.process is not None and self._alive(worker):
            with self._reap_lock:
                worker.process.kill()
                worker.process.join(5)

    def _dispatch(self, message: Any) -> None:
        """Route one message from the worker (a step's messages all at once): one wake-up of
        each waiting event loop per message, with every delivery of the step for it in order
        (a wake-up per request cost a self-pipe write each, ~15 per talker step under load)."""
        deliveries: list[tuple[_Waiter, Any]] = []
        self._collect(message, deliveries)
        loops: dict[asyncio.AbstractEventLoop, list[tuple[_Waiter, Any]]] = {}
        for waiter, item in deliveries:
            loops.setdefault(waiter.loop, []).append((waiter, item))
        for loop, items in loops.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # that event loop is closed: nobody waits any more
                pass

    def _collect(self, message: Any, deliveries: list[tuple[_Waiter, Any]]) -> None:
        if isinstance(message, msg.Heartbeat):
            if message.load is not None:
                self.engine_load = message.load
            return
        if isinstance(message, msg.StepMessages):
            for each in message.messages:
                self._collect(each, deliveries)
            return
        if isinstance(message, msg.ControlResult):
            with self._lock:
                future = self._calls.pop(message.call_id, None)
            if future is None:
                log.debug("%s: dropping a late answer to control call %d", self.name, message.call_id)
            elif message.error:
                future.set_exception(StageError(f"{self.name} control call failed: {message.error}"))
            else:
                future.set_result(message.value)
            return
        request_id = getattr(message, "request_id", None)
        with self._lock:
            waiter = self._waiters.get(request_id) if request_id is not None else None
        if waiter is None:  # an answer to a request that timed out or was aborted
            log.debug("%s: dropping a late %s for %s", self.name, type(message).__name__, request_id)
            return
        if isinstance(message, msg.GenerateFailed):
            error = StageError(f"{self.name} failed request {request_id}: {message.message}")
            error.kind = _failure_kind(message.message)  # type: ignore[attr-defined]
            message = error
        deliveries.append((waiter, message))

    def _fail_all(self, error: StageError) -> None:
        with self._lock:
            # Later sends fail at once with why the stage is unavailable (restarting, down).
            self._dead = self.unavailable() or error
            waiters, self._waiters = list(self._waiters.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for waiter in waiters:
            try:
                waiter.loop.call_soon_threadsafe(waiter.deliver, error)
            except RuntimeError:
                pass
        for future in calls:
            if not future.done():
                future.set_exception(error)

    # ---- requests ----------------------------------------------------------------------------
    def _send_locked(self, message: Any) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            self._worker.conn.send_bytes(msg.dumps(message))
        except (BrokenPipeError, OSError) as exc:
            raise StageError(
                f"{self.name}: {self._gone(self._worker)} before the message was sent; it is "
                "restarted unless it died too often"
            ) from exc

    def _gone(self, worker: _Worker) -> str:
        """What became of a worker whose pipe broke: a local process's exit, with its signal,
        once its sentinel says so (a broken pipe can beat the exit by a moment; the wait is
        short and only on this error path), else the worker named."""
        process = worker.process
        if isinstance(process, mp.process.BaseProcess) and multiprocessing.connection.wait(
            [process.sentinel], SEND_EXIT_WAIT_S
        ):
            return self._cause(worker)
        return f"{self._which(worker)} went away"

    @staticmethod
    def _which(worker: _Worker) -> str:
        """The worker as a message names it, without waiting on it (the send path holds a lock)."""
        process = worker.process
        if process is None:
            return "its in-process engine thread"
        if isinstance(process, mp.process.BaseProcess):
            return f"its worker (pid {worker.pid})"
        return f"its Ray actor (pid {process.pid} on {process.node_ip})"

    def submit(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_chunk: Callable[[Any], None] | None = None,
        chunk_sizes: tuple[int, int] | None = None,
        rows: bool = True,
    ) -> "_Waiter":
        """Send a request now (on the event loop's thread) and register who waits for it:
        anything sent for it afterwards (`append`, `abort`) reaches the worker after it. Await
        `result()` for its output. `on_tokens` gets streamed token deltas and `on_chunk` streamed
        chunks, on the event loop; an exception from either fails the request. `chunk_sizes`
        and `rows`: see `StageEngine.add_request`."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), on_tokens, on_chunk)
        with self._lock:
            if request_id in self._waiters:
                raise StageError(f"{self.name} already runs request {request_id}")
            self._waiters[request_id] = waiter
            try:
                self._send_locked(
                    msg.AddRequest(
                        request_id,
                        prompt,
                        params,
                        stream=on_tokens is not None or on_chunk is not None,
                        chunks=on_chunk is not None,
                        chunk_sizes=chunk_sizes,
                        rows=rows,
                    )
                )
            except BaseException:
                del self._waiters[request_id]
                raise
        return waiter

    async def result(self, request_id: str, waiter: "_Waiter", timeout_s: float) -> Any:
        """The output of a submitted request. On timeout, a failing callback or cancellation
        the worker is told to abort it."""
        finished = False
        try:
            result = await asyncio.wait_for(waiter.future, max(timeout_s, 0.0))
            finished = True
            return result
        except asyncio.TimeoutError:
            raise StageTimeout(
                f"{self.name} did not finish request {request_id} within "
                f"{timeout_s:.1f} s; raise the request timeout if the stage is just "
                "slow"
            ) from None
        except StageError:
            finished = True  # the worker answered (failed) or died: nothing left to abort
            raise
        finally:
            with self._lock:
                if self._waiters.get(request_id) is waiter:
                    del self._waiters[request_id]
            if not finished:
                self.abort(request_id)

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        timeout_s: float,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_chunk: Callable[[Any], None] | None = None,
        rows: bool = True,
    ) -> Any:
        """`submit` then `result`."""
        waiter = self.submit(request_id, prompt, params, on_tokens, on_chunk, rows=rows)
        return await self.result(request_id, waiter, timeout_s)

    def append(self, request_id: str, data: Any, final: bool) -> None:
        """More input for a request submitted with a prompt that said more follows. Dropped when
        the request is no longer in flight (aborted, failed)."""
        with self._lock:
            if request_id not in self._waiters:
                return
            self._send_locked(msg.AppendInput(request_id, data, final))

    def abort(self, request_id: str) -> None:
        """Ask the worker to stop `request_id`; harmless if it already finished. The worker
        answers an abort with nothing, so whoever waits for the request gets a StageError now."""
        with self._lock:
            waiter = self._waiters.pop(request_id, None)
            try:
                self._send_locked(msg.Abort(request_id))
            except StageError:
                pass
        if waiter is not None:
            try:
                waiter.loop.call_soon_threadsafe(
                    waiter.deliver, StageError(f"{self.name}: request {request_id} was aborted")
                )
            except RuntimeError:  # that event loop is closed: nobody waits any more
                pass

    def in_flight(self) -> int:
        with self._lock:
            return len(self._waiters)

    # ---- control calls -------------------------------------------------------------------------
    def control_future(self, name: str, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            try:
                self._send_locked(msg.ControlRequest(call_id, name, kwargs))
            except BaseException:
                del self._calls[call_id]
                raise
        future.call_id = call_id  # type: ignore[attr-defined]
        return future

    def forget_call(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._calls.pop(getattr(future, "call_id", -1), None)

    def control(self, name: str, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        future = self.control_future(name, **kwargs)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.forget_call(future)
            raise StageTimeout(
                f"{self.name} did not answer control call {name} within {timeout_s:.1f} s"
            ) from None

    async def control_async(self, name: str, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        return await self.await_call(self.control_future(name, **kwargs), name, timeout_s)

    async def await_call(self, future: concurrent.futures.Future, name: str, timeout_s: float) -> Any:
        """The answer to a control call already sent (`control_future`), or StageTimeout."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            self.forget_call(future)
            raise StageTimeout(
                f"{self.name} did not answer control call {name} within {timeout_s:.1f} s"
            ) from None

    # ---- shutdown ------------------------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Ask the worker to stop without waiting (close() waits): workers stop in parallel."""
        with self._lock:
            self._closing = True
            worker = self._worker
        self._stop.set()
        if self._alive(worker) and worker.conn is not None:
            with self._lock:
                try:
                    worker.conn.send_bytes(msg.dumps(msg.Shutdown()))
                except (BrokenPipeError, OSError):
                    pass

    def close(self, timeout_s: float = 10.0) -> None:
        self.request_shutdown()
        worker = self._worker
        if worker.process is not None:
            with self._reap_lock:
                worker.process.join(timeout_s)
                if worker.process.is_alive():
                    log.warning("%s did not stop within %.0f s; terminating it", self.name, timeout_s)
                    worker.process.terminate()
                    worker.process.join(5)
                if worker.process.is_alive():
                    worker.process.kill()
                    worker.process.join()
            if self._is_actor(worker):
                worker.process.kill()  # its worker loop has ended; the actor has not
        else:
            assert worker.thread is not None, "a worker is a process, a Ray actor or a thread"
            worker.thread.join(timeout_s)
        with self._lock:
            self.status = StageStatus.CLOSED
        self._fail_all(StageError(f"{self.name} stopped at shutdown"))
        self._notify()
        if worker.conn is not None:
            worker.conn.close()
