"""Fix (b): an in-process vLLM engine keeps stepping until its pending KV sends finish.

Upstream (vLLM 0.32.0): a prefill request that ends length-capped keeps its blocks for the decode
side; the connector learns which blocks to send only from the metadata of the *next* scheduler
step, and frees them only after a later step reports the send finished. The engine-core process
(`VLLM_ENABLE_V1_MULTIPROCESSING=1`) keeps stepping on its own while `scheduler.has_requests()`,
but an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the offline `LLM` / `LLMEngine`
API) steps only when its caller does, and callers stop once no request is unfinished
(`LLMEngine.has_unfinished_requests()` only looks at the output processor). So after the prefill
`generate()` returns, nobody steps: the decode side waits for KV until
`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` (480 s) and the prefill blocks stay allocated.

Patched: `LLMEngine.step`, `add_request` and `abort_request` are serialised by a per-engine lock,
and when a step leaves the in-process scheduler with work (finished requests whose blocks wait
for a KV send or, on a decode engine, for an aborted request's receive to settle; pending
connector work) but no unfinished request, a daemon thread keeps stepping
the engine (every `DRAIN_INTERVAL_S`) until that work is gone -- sent, or expired by the
connector's own timeout. `generate()` still returns as soon as its requests finish. Engines with
a separate engine-core process are left alone.
"""

from __future__ import annotations

import threading
import weakref

from ._guard import Patch, log, mark_patched

SUPPORTED = ("0.32.0",)
DRAIN_INTERVAL_S = 0.005  # between idle steps while sends are pending (first step is immediate)


class _DrainState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.wake = threading.Event()


def _state(engine) -> _DrainState:
    state = engine.__dict__.get("_omni_pd_drain")
    if state is None:
        state = engine.__dict__.setdefault("_omni_pd_drain", _DrainState())
    return state


def _inproc_scheduler(engine):
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient
    return getattr(core, "scheduler", None)


def pending_connector_work(engine) -> bool:
    """True while the in-process scheduler holds requests or connector work that nobody will
    step for: no request is unfinished from the caller's point of view."""
    scheduler = _inproc_scheduler(engine)
    if scheduler is None or getattr(scheduler, "connector", None) is None:
        return False
    if engine.output_processor.has_unfinished_requests():
        return False  # the caller is stepping
    # `has_requests()` turns False once a finished request has been reported, but the scheduler
    # may still hold it: a prefill's blocks waiting for their send, or an aborted decode leg's
    # blocks waiting for the connector to settle its receive. Only a step collects either.
    return bool(scheduler.has_requests()) or bool(scheduler.requests)


def stop_draining(engine) -> None:
    """Stop the background stepping of `engine` (call before shutting the engine down)."""
    state = _state(engine)
    with state.lock:
        state.closed = True
        state.wake.set()
        thread = state.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5)


def _drain(engine_ref, state: _DrainState, step) -> None:
    while True:
        engine = engine_ref()
        if engine is None:
            return
        with state.lock:
            if state.closed or not pending_connector_work(engine):
                state.thread = None
                return
            try:
                step(engine)  # no request is unfinished, so there is no output to lose
            except Exception:
                log.exception("omni-pd: stepping the engine for pending KV sends failed")
                state.thread = None
                return
        del engine
        state.wake.wait(DRAIN_INTERVAL_S)


def _install() -> str | None:
    from vllm.v1.engine.llm_engine import LLMEngine

    original_step = LLMEngine.step
    original_add = LLMEngine.add_request
    original_abort = LLMEngine.abort_request

    def step(self, *args, **kwargs):
        state = _state(self)
        with state.lock:
            outputs = original_step(self, *args, **kwargs)
            if state.thread is None and not state.closed and pending_connector_work(self):
                state.thread = threading.Thread(
                    target=_drain,
                    args=(weakref.ref(self), state, original_step),
                    name="omni-pd-kv-drain",
                    daemon=True,
                )
                state.thread.start()
        return outputs

    def add_request(self, *args, **kwargs):
        with _state(self).lock:
            return original_add(self, *args, **kwargs)

    def abort_request(self, *args, **kwargs):
        with _state(self).lock:
            return original_abort(self, *args, **kwargs)

    mark_patched(LLMEngine, "step", step)
    mark_patched(LLMEngine, "add_request", add_request)
    mark_patched(LLMEngine, "abort_request", abort_request)
    return None


PATCH = Patch(
    name="offline_drain",
    what="in-process LLMEngine keeps stepping in the background until pending KV sends finish",
    supported=SUPPORTED,
    install=_install,
)
