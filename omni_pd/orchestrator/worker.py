"""A stage worker: one process that builds one stage engine and serves it over a pipe.

The worker ignores SIGINT (Ctrl-C reaches the whole process group; the orchestrator decides
when workers stop) and exits on a Shutdown message, when the pipe closes, or when its parent
is gone, so a killed orchestrator never leaves a worker (nor its Mooncake port) behind.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import Any

from . import messages as msg

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.5  # how often an idle worker runs engine housekeeping (lease expiry)


def worker_main(stage_config: Any, model: str, conn, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, stream=sys.stderr, force=True,
                        format=f"%(asctime)s %(levelname)s [stage{stage_config.stage_id}] %(name)s: %(message)s")
    parent = os.getppid()
    stage_id = stage_config.stage_id
    try:
        from .engine_factory import build_engine
        engine = build_engine(stage_config, model)
    except BaseException as exc:  # report, then exit: the orchestrator raises with this message
        conn.send_bytes(msg.dumps(msg.StartupFailed(stage_id, f"{type(exc).__name__}: {exc}")))
        conn.close()
        return
    conn.send_bytes(msg.dumps(msg.Ready(stage_id, os.getpid(), engine.describe())))
    try:
        while os.getppid() == parent:
            if not conn.poll(IDLE_POLL_S):
                engine.housekeeping()
                continue
            try:
                message = msg.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the orchestrator is gone
            if isinstance(message, msg.Shutdown):
                break
            inbox = BusyInbox(conn)
            reply = _handle(engine, message, inbox)
            if reply is not None:
                conn.send_bytes(msg.dumps(reply))
            if inbox.shutdown_requested:
                break  # a Shutdown arrived while the request ran (and stopped it)
            engine.housekeeping()
    finally:
        engine.close()
        conn.close()


class RequestAborted(RuntimeError):
    pass


class BusyInbox:
    """The pipe as seen while a request runs: only Abort and Shutdown can arrive then (the
    orchestrator holds a stage's lock for every other call). A Shutdown stops the request and is
    remembered, so the main loop exits after replying."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.shutdown_requested = False

    def token_callback(self, message: msg.GenerateRequest):
        """Called by a text engine after each token: streams it when asked, and stops the request
        when an Abort for it (or a Shutdown) has arrived."""
        def on_token(token_id: int) -> None:
            while self.conn.poll(0):
                incoming = msg.loads(self.conn.recv_bytes())
                if isinstance(incoming, msg.Shutdown):
                    self.shutdown_requested = True
                    raise RequestAborted("the worker is shutting down")
                if isinstance(incoming, msg.Abort) and incoming.request_id == message.request_id:
                    raise RequestAborted(f"request {message.request_id} was aborted")
                # an Abort for a request that already finished here: nothing to stop
            if message.stream:
                self.conn.send_bytes(msg.dumps(msg.TokenDelta(message.request_id, [token_id])))
        return on_token


def _handle(engine, message, inbox: BusyInbox):
    if isinstance(message, msg.GenerateRequest):
        try:
            output = engine.generate(message.request_id, message.prompt, message.params,
                                     on_token=inbox.token_callback(message))
            return msg.GenerateResult(message.request_id, output)
        except Exception as exc:
            log.debug("request %s failed:\n%s", message.request_id, traceback.format_exc())
            return msg.GenerateFailed(message.request_id, f"{type(exc).__name__}: {exc}")
    if isinstance(message, msg.ControlRequest):
        try:
            return msg.ControlResult(message.call_id, engine.control(message.name, **message.kwargs))
        except Exception as exc:
            return msg.ControlResult(message.call_id, error=f"{type(exc).__name__}: {exc}")
    if isinstance(message, msg.Abort):
        return None  # the request already finished here: nothing to stop
    raise TypeError(f"unexpected message {type(message).__name__}")
