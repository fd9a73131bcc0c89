"""The orchestrator's handle on one stage worker: many requests in flight over one pipe.

A reader thread takes every message the worker sends and hands it to whoever waits for it: a
request's token deltas and final answer go to that request's asyncio future (on the event loop
that submitted it), a control call's answer to its call id. Sends from any thread are serialised.
When the worker dies, every waiter fails at once with a message naming the stage and its exit
code.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..sampling import SamplingParams
from . import messages as msg
from .worker import thread_main, worker_main

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often the reader checks that the worker is still alive


class StageError(RuntimeError):
    """A stage failed a request, died, or missed its deadline; the message names the stage."""


class StageTimeout(StageError):
    pass


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
        if isinstance(message, msg.TokenDelta):
            if self.on_tokens is not None:
                self.on_tokens(message.token_ids)
        elif isinstance(message, msg.ChunkOutput):
            if self.on_chunk is not None:
                try:
                    self.on_chunk(message.data)
                except Exception as exc:  # noqa: BLE001 - the consumer failed: so does the request
                    self.future.set_exception(exc)
        elif isinstance(message, msg.GenerateResult):
            self.future.set_result(message.output)
        elif isinstance(message, StageError):
            self.future.set_exception(message)


class StageClient:
    def __init__(self, stage_config: Any, model: str, startup_timeout_s: float,
                 threads: tuple[int, int] = (1, 1)):
        self.stage_id = stage_config.stage_id
        self.model_stage = stage_config.model_stage
        self.startup_timeout_s = startup_timeout_s
        self.threads = threads
        name = f"omni-pd-stage{self.stage_id}-{self.model_stage}"
        if stage_config.runtime.process:
            context = mp.get_context("spawn")
            self._conn, child = context.Pipe(duplex=True)
            self.process = context.Process(
                target=worker_main, name=name, daemon=True,
                args=(stage_config, model, child, logging.getLogger().getEffectiveLevel(), threads))
            self.process.start()
            child.close()
            self._thread = None
        else:  # the engine on a thread of this process, behind the same pipe protocol
            self._conn, child = mp.Pipe(duplex=True)
            self.process = None
            self._thread = threading.Thread(target=thread_main, name=name, daemon=True,
                                            args=(stage_config, model, child))
            self._thread.start()
        self.info: dict[str, Any] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # guards sends, _waiters, _calls, _dead
        self._waiters: dict[str, _Waiter] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._dead: StageError | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        # Reaping the worker (join, exitcode) from two threads at once races in waitpid: the
        # loser sees "no such child" and takes a dead worker for alive. One lock for all reaping.
        self._reap_lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"stage {self.stage_id} ({self.model_stage})"

    def alive(self) -> bool:
        if self.process is not None:  # the sentinel says so without reaping the process
            return not multiprocessing.connection.wait([self.process.sentinel], 0)
        return self._thread.is_alive()

    def _exit_description(self) -> str:
        if self.process is not None:
            with self._reap_lock:
                self.process.join(1.0)
                code = self.process.exitcode
            return f"worker (pid {self.process.pid}) exited with code {code}"
        return "in-process engine thread stopped"

    def _exited(self, doing: str) -> StageError:
        return StageError(f"{self.name} {self._exit_description()} {doing}; its log above says why, "
                          "and a new Omni / server is needed to serve this stage again")

    # ---- start-up ----------------------------------------------------------------------------
    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                if self._conn.poll(POLL_S):
                    reply = msg.loads(self._conn.recv_bytes())
                    break
            except (EOFError, OSError):
                pass
            if not self.alive():
                raise self._exited("while starting")
            if time.monotonic() > deadline:
                raise StageTimeout(f"{self.name} did not start within {self.startup_timeout_s:.0f} s")
        if isinstance(reply, msg.StartupFailed):
            raise StageError(f"{self.name} failed to start: {reply.message}")
        self.info = reply.info
        where = f"worker pid {reply.pid}" if self.process is not None else "this process"
        log.info("%s ready in %s (%d intra-op / %d inter-op threads)", self.name, where, *self.threads)
        self._reader = threading.Thread(target=self._read, name=f"omni-pd-stage{self.stage_id}-reader",
                                        daemon=True)
        self._reader.start()

    # ---- the reader thread -------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                if self._conn.poll(POLL_S):
                    self._dispatch(msg.loads(self._conn.recv_bytes()))
                    continue
            except (EOFError, OSError):
                pass
            else:
                if self.alive():
                    continue
            # The pipe closed or the worker is gone: fail whoever still waits.
            self._fail_all(self._exited("while requests were in flight" if not self._closing
                                        else "at shutdown"))
            return

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, msg.StepMessages):
            for each in message.messages:
                self._dispatch(each)
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
            waiter = self._waiters.get(request_id)
        if waiter is None:  # an answer to a request that timed out or was aborted
            log.debug("%s: dropping a late %s for %s", self.name, type(message).__name__, request_id)
            return
        if isinstance(message, msg.GenerateFailed):
            message = StageError(f"{self.name} failed request {request_id}: {message.message}")
        try:
            waiter.loop.call_soon_threadsafe(waiter.deliver, message)
        except RuntimeError:  # that event loop is closed: nobody waits any more
            pass

    def _fail_all(self, error: StageError) -> None:
        with self._lock:
            self._dead = error
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
            self._conn.send_bytes(msg.dumps(message))
        except (BrokenPipeError, OSError) as exc:
            raise self._exited("before the message was sent") from exc

    def submit(self, request_id: str, prompt: Any, params: SamplingParams,
               on_tokens: Callable[[list[int]], None] | None = None,
               on_chunk: Callable[[Any], None] | None = None) -> "_Waiter":
        """Send a request now (on the event loop's thread) and register who waits for it:
        anything sent for it afterwards (`append`, `abort`) reaches the worker after it. Await
        `result()` for its output. `on_tokens` gets streamed token deltas and `on_chunk` streamed
        chunks, on the event loop; an exception from either fails the request."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), on_tokens, on_chunk)
        with self._lock:
            if request_id in self._waiters:
                raise StageError(f"{self.name} already runs request {request_id}")
            self._waiters[request_id] = waiter
            try:
                self._send_locked(msg.AddRequest(request_id, prompt, params,
                                                 stream=on_tokens is not None or on_chunk is not None,
                                                 chunks=on_chunk is not None))
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
            raise StageTimeout(f"{self.name} did not finish request {request_id} within "
                               f"{timeout_s:.1f} s; raise the request timeout if the stage is just "
                               "slow") from None
        except StageError:
            finished = True  # the worker answered (failed) or died: nothing left to abort
            raise
        finally:
            with self._lock:
                if self._waiters.get(request_id) is waiter:
                    del self._waiters[request_id]
            if not finished:
                self.abort(request_id)

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams, timeout_s: float,
                       on_tokens: Callable[[list[int]], None] | None = None,
                       on_chunk: Callable[[Any], None] | None = None) -> Any:
        """`submit` then `result`."""
        waiter = self.submit(request_id, prompt, params, on_tokens, on_chunk)
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
                    waiter.deliver, StageError(f"{self.name}: request {request_id} was aborted"))
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
            raise StageTimeout(f"{self.name} did not answer control call {name} within "
                               f"{timeout_s:.1f} s") from None

    async def control_async(self, name: str, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        future = self.control_future(name, **kwargs)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            self.forget_call(future)
            raise StageTimeout(f"{self.name} did not answer control call {name} within "
                               f"{timeout_s:.1f} s") from None

    # ---- shutdown ------------------------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Ask the worker to stop without waiting (close() waits): workers stop in parallel."""
        self._closing = True
        if self.alive():
            with self._lock:
                try:
                    self._conn.send_bytes(msg.dumps(msg.Shutdown()))
                except (BrokenPipeError, OSError):
                    pass

    def close(self, timeout_s: float = 10.0) -> None:
        self.request_shutdown()
        if self.process is not None:
            with self._reap_lock:
                self.process.join(timeout_s)
                if self.process.is_alive():
                    log.warning("%s did not stop within %.0f s; terminating it", self.name, timeout_s)
                    self.process.terminate()
                    self.process.join(5)
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join()
        else:
            self._thread.join(timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)
        self._fail_all(self._exited("at shutdown"))
        self._conn.close()
