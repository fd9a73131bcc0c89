"""The orchestrator's handle on one stage worker process."""
from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
import time
from typing import Any, Callable

from ..sampling import SamplingParams
from . import messages as msg
from .worker import worker_main

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often a waiting orchestrator checks that the worker is still alive


class StageError(RuntimeError):
    """A stage failed a request, died, or missed its deadline; the message names the stage."""


class StageTimeout(StageError):
    pass


class StageClient:
    def __init__(self, stage_config: Any, model: str, startup_timeout_s: float):
        self.stage_id = stage_config.stage_id
        self.model_stage = stage_config.model_stage
        self.startup_timeout_s = startup_timeout_s
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe(duplex=True)
        self.process = context.Process(
            target=worker_main, name=f"omni-pd-stage{self.stage_id}-{self.model_stage}",
            args=(stage_config, model, child, logging.getLogger().getEffectiveLevel()), daemon=True)
        self.process.start()
        child.close()
        self.info: dict[str, Any] = {}
        self._calls = itertools.count()
        # The orchestrator serialises requests per stage, but an Abort may be sent from another
        # thread while a request is in flight: sends never interleave.
        self._send_lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"stage {self.stage_id} ({self.model_stage})"

    def wait_ready(self) -> None:
        reply = self._receive(self.startup_timeout_s, "while starting")
        if isinstance(reply, msg.StartupFailed):
            raise StageError(f"{self.name} failed to start: {reply.message}")
        self.info = reply.info
        log.info("%s ready in worker pid %d", self.name, reply.pid)

    def _receive(self, timeout_s: float, doing: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StageTimeout(f"{self.name} did not answer within {timeout_s:.1f} s {doing}; "
                                   "raise the request timeout if the stage is just slow")
            try:
                if self._conn.poll(min(POLL_S, remaining)):
                    return msg.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                pass
            if not self.process.is_alive():
                raise self._exited(doing)

    def _receive_matching(self, deadline: float, doing: str, is_mine: Callable[[Any], bool]) -> Any:
        """The next message `is_mine` accepts. Others are late answers to a request that timed out
        (or to an older control call): nobody waits for them any more, so they are dropped."""
        while True:
            reply = self._receive(max(deadline - time.monotonic(), 0.0), doing)
            if is_mine(reply):
                return reply
            log.debug("%s: dropping a late %s", self.name, type(reply).__name__)

    def _send(self, message: Any) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(msg.dumps(message))
        except (BrokenPipeError, OSError) as exc:
            self.process.join(1.0)
            raise self._exited("before the request was sent") from exc

    def _exited(self, doing: str) -> StageError:
        return StageError(f"{self.name} worker (pid {self.process.pid}) exited with code "
                          f"{self.process.exitcode} {doing}; its log above says why, and a new "
                          "Omni / server is needed to serve this stage again")

    def generate(self, request_id: str, prompt: Any, params: SamplingParams, timeout_s: float,
                 on_tokens: Callable[[list[int]], None] | None = None) -> Any:
        self._send(msg.GenerateRequest(request_id, prompt, params, stream=on_tokens is not None))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self._receive_matching(
                    deadline, f"for request {request_id}",
                    lambda r: getattr(r, "request_id", None) == request_id)
            except StageTimeout:
                self.abort(request_id)  # a text stage stops at its next token; its answer is dropped
                raise
            if not isinstance(reply, msg.TokenDelta):
                break
            on_tokens(reply.token_ids)
        if isinstance(reply, msg.GenerateFailed):
            raise StageError(f"{self.name} failed request {request_id}: {reply.message}")
        return reply.output

    def abort(self, request_id: str) -> None:
        """Ask the worker to stop `request_id`; harmless if it already finished."""
        try:
            self._send(msg.Abort(request_id))
        except StageError:
            pass

    def control(self, name: str, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        call_id = next(self._calls)
        self._send(msg.ControlRequest(call_id, name, kwargs))
        reply = self._receive_matching(
            time.monotonic() + timeout_s, f"to control call {name}",
            lambda r: isinstance(r, msg.ControlResult) and r.call_id == call_id)
        if reply.error:
            raise StageError(f"{self.name} control call {name} failed: {reply.error}")
        return reply.value

    def request_shutdown(self) -> None:
        """Ask the worker to stop without waiting (close() waits): workers stop in parallel."""
        if self.process.is_alive():
            try:
                with self._send_lock:
                    self._conn.send_bytes(msg.dumps(msg.Shutdown()))
            except (BrokenPipeError, OSError):
                pass

    def close(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive():
            self.request_shutdown()
            self.process.join(timeout_s)
        if self.process.is_alive():
            log.warning("%s did not stop within %.0f s; terminating it", self.name, timeout_s)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()


class LocalStageClient:
    """The same interface with the engine in this process (`runtime.process: false`)."""

    def __init__(self, stage_config: Any, model: str):
        from .engine_factory import build_engine
        self.stage_id = stage_config.stage_id
        self.model_stage = stage_config.model_stage
        self.engine = build_engine(stage_config, model)
        self.info = self.engine.describe()
        self.process = None
        self._running: set[str] = set()
        self._aborted: set[str] = set()

    def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    def wait_ready(self) -> None:
        pass

    def generate(self, request_id: str, prompt: Any, params: SamplingParams, timeout_s: float,
                 on_tokens: Callable[[list[int]], None] | None = None) -> Any:
        def on_token(token_id: int) -> None:
            if request_id in self._aborted:
                raise RuntimeError(f"request {request_id} was aborted")
            if on_tokens is not None:
                on_tokens([token_id])
        self._running.add(request_id)
        try:
            return self.engine.generate(request_id, prompt, params, on_token=on_token)
        except Exception as exc:
            raise StageError(f"stage {self.stage_id} ({self.model_stage}) failed request "
                             f"{request_id}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    def control(self, name: str, timeout_s: float = 30.0, **kwargs: Any) -> Any:
        return self.engine.control(name, **kwargs)

    def request_shutdown(self) -> None:
        pass

    def close(self, timeout_s: float = 10.0) -> None:
        self.engine.close()
