"""The routes besides chat completions: /health, /v1/models, /metrics, /debug/state and the
Realtime API's websocket /v1/realtime."""

from __future__ import annotations

import logging

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .errors import as_api_error
from .middleware import WS_POLICY_VIOLATION, WS_TRY_AGAIN_LATER
from .protocol import REALTIME_PATH
from .realtime import subprotocols
from .realtime.session import RealtimeSession
from .server_state import ServerState

log = logging.getLogger(__name__)


# ---- /health, /v1/models, /metrics, /debug/state --------------------------------------------
def add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        if state.omni is None:
            return JSONResponse(
                {"status": "failed" if state.startup_error else "starting", "error": state.startup_error},
                status_code=503,
            )
        # 503 while any stage restarts, is down or is silent; the body names it and says why.
        report = state.omni.health()
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": state.served_model, "object": "model", "created": 0, "owned_by": "omni-pd"}],
        }

    @app.get("/metrics")
    async def metrics():
        if state.omni is not None:
            state.metrics.observe_health(state.omni.health())
            state.metrics.queued.set(state.admission.queued)
        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def add_debug_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/debug/state")
    async def debug_state():
        omni = state.ready_omni()
        counts = {**await omni.debug_state_counts(), **state.admission.counts()}
        sessions = list(state.realtime_sessions)
        counts["realtime.sessions"] = len(sessions)
        for key in ("responses", "items", "buffer_bytes"):
            counts[f"realtime.{key}"] = sum(s.counts()[key] for s in sessions)
        return {"counts": counts, "worker_pids": omni.worker_pids}


# ---- /v1/realtime ---------------------------------------------------------------------------
def _realtime_refusal(state: ServerState, model: str | None) -> tuple[str, int] | None:
    """Why a socket cannot have a session (and its close code), or None when it can."""
    if state.omni is None:
        return (
            state.startup_error or "the stages are still starting; retry when GET /health answers 200"
        ), WS_TRY_AGAIN_LATER
    if model is not None and model != state.served_model:
        return (
            f"the model {model!r} does not exist; this server serves {state.served_model!r}"
        ), WS_POLICY_VIOLATION
    return None


def add_realtime_route(app: FastAPI, state: ServerState) -> None:
    @app.websocket(REALTIME_PATH)
    async def realtime(websocket: WebSocket):
        """The Realtime API: one session per socket (realtime/session.py)."""
        # A browser offers `realtime` (and its key, checked by RequestGuard): it must be answered.
        await websocket.accept(subprotocol=subprotocols.chosen(websocket.scope))
        model = websocket.query_params.get("model")
        refusal = _realtime_refusal(state, model)
        if refusal is not None:
            reason, code = refusal
            await websocket.send_json(
                {
                    "type": "error",
                    "event_id": "event_refused",
                    "error": {
                        "type": "invalid_request_error",
                        "code": "model_not_found" if model else None,
                        "message": reason,
                        "param": "model",
                        "event_id": None,
                    },
                }
            )
            await websocket.close(code, reason[:120])
            return
        beta = websocket.headers.get("openai-beta", "").startswith("realtime=v1") or subprotocols.wants_beta(
            websocket.scope
        )
        session = RealtimeSession(
            websocket, state.omni, state, state.served_model, lambda exc: as_api_error(state, exc), beta=beta
        )
        state.realtime_sessions.add(session)
        state.metrics.realtime_sessions.inc()
        log.debug("realtime session %s opened", session.id)
        try:
            await session.run()
        finally:
            state.realtime_sessions.discard(session)
            state.metrics.realtime_sessions.dec()
            log.debug("realtime session %s closed", session.id)
