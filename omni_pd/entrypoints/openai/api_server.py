"""OpenAI-compatible HTTP server over `AsyncOmni`: /v1/chat/completions (text and speech,
streaming or not), the Realtime API's websocket /v1/realtime (realtime/), /v1/models, /health,
/metrics.

Hostile input: bodies over `max_request_bytes` are refused (413) before they are read, /v1/* needs
`Authorization: Bearer <api_key>` when a key is set (401), every other problem is a 400 in
OpenAI's error shape naming the field, and the CPU work a request brings (decoding its audio,
tokenizing its text) runs off the event loop, so one request cannot stall the others."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...audio_io import PCM16_SAMPLE_RATE, pcm16_bytes, stage_config_pcm16_gain, write_wav
from ...orchestrator.async_omni import (
    AsyncOmni,
    AudioDelta,
    Finished,
    PreparedPrompt,
    PromptTooLong,
    RequestAborted,
    RequestTimeout,
    TextDelta,
)
from ...orchestrator.heap import freeze_startup_heap
from ...orchestrator.outputs import OmniRequestOutput
from ...orchestrator.stage_client import StageError, StageTimeout, StageUnavailable
from .admission import DEFAULT_QUEUE_FACTOR, AdmissionControl, Slot
from .demo import add_demo_routes
from .metrics import ServerMetrics
from .protocol import DEFAULT_MAX_REQUEST_BYTES, APIError, ChatCompletionRequest
from .realtime import subprotocols
from .realtime.session import RealtimeSession
from .translate import TranslatedRequest, translate

log = logging.getLogger(__name__)
AUDIO_EXPIRES_S = 3600  # `expires_at`: OpenAI's audio ids expire; omni-pd keeps no audio at all
CHAT_PATH = "/v1/chat/completions"
REALTIME_PATH = "/v1/realtime"
# Websocket close codes (RFC 6455): a policy the client broke (its key, its model), and a server
# that cannot serve yet.
WS_POLICY_VIOLATION, WS_TRY_AGAIN_LATER = 1008, 1013


class _ErrorJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        # ASCII: an error quoting a client's invalid text (a lone surrogate) still encodes.
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return _ErrorJSONResponse(error.body.model_dump(), status_code=error.status, headers=headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: tuple) -> str | None:
    """pydantic's ("body", "messages", 0, "content") -> "messages[0].content", as translate names
    fields."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part:  # which member of a union failed, not a field
            continue
        else:
            out += f".{part}" if out else part
    return out or None


class _BodyTooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware that refuses, before the app reads a byte of the body: /v1/* requests
    without `Authorization: Bearer <api_key>` (401; /health and /metrics stay open, as in vLLM),
    and bodies over `max_request_bytes` (413), by their Content-Length or, without one, by
    counting the body as it streams in."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key)

    def _too_large(self) -> JSONResponse:
        limit = self.max_request_bytes
        return _error_response(
            APIError(
                413,
                f"the request body is over this server's limit of {limit} bytes "
                f"({limit / 2**20:g} MiB); send less (a shorter audio clip, or FLAC / OGG instead of "
                "WAV), or start the server with a larger --max-request-bytes",
                code="request_too_large",
            )
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if (
            self.api_key
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
            and not self._authorized(headers)
        ):
            response = _error_response(
                APIError(
                    401,
                    "missing or incorrect API key: send the header `Authorization: Bearer <key>` "
                    "with the key the server was started with (--api-key or OMNI_PD_API_KEY)",
                    code="invalid_api_key",
                ),
                headers={"www-authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        limit = self.max_request_bytes
        if not limit:
            return await self.app(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return await self._too_large()(scope, receive, send)
        received, refused, started = 0, False, False

        async def counted_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        await self._too_large()(scope, receive, send)
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 is the answer; the app's own (to the error it got) is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not refused:
                raise

    def _subprotocol_authorized(self, scope: Scope) -> bool:
        key = subprotocols.offered_api_key(scope)
        return key is not None and secrets.compare_digest(key.encode(), self.api_key)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The same key rule for /v1 websockets (the Realtime API), checked at the handshake; the
        key comes as the header or, from browsers, as the subprotocol
        `openai-insecure-api-key.<key>` (realtime/subprotocols.py). A client that offered
        subprotocols (a browser, which cannot read a refused handshake's status) is refused in
        the protocol: the socket opens, one `error` event (code `invalid_api_key`), then a close
        with 1008. Other clients get a 401 where the server can answer a handshake with HTTP
        (uvicorn can), else the 1008 close."""
        if (
            not self.api_key
            or not scope["path"].startswith("/v1")
            or self._authorized(Headers(scope=scope))
            or self._subprotocol_authorized(scope)
        ):
            return await self.app(scope, receive, send)
        await receive()  # websocket.connect
        if subprotocols.offered(scope):
            await send({"type": "websocket.accept", "subprotocol": subprotocols.chosen(scope)})
            await send(
                {
                    "type": "websocket.send",
                    "text": json.dumps(
                        {
                            "type": "error",
                            "event_id": "event_refused",
                            "error": {
                                "type": "invalid_request_error",
                                "code": "invalid_api_key",
                                "param": None,
                                "event_id": None,
                                "message": "missing or incorrect API key: offer the "
                                "subprotocol `openai-insecure-api-key.<key>` (or send the header "
                                "`Authorization: Bearer <key>`) with the key the server was started with",
                            },
                        }
                    ),
                }
            )
            await send(
                {
                    "type": "websocket.close",
                    "code": WS_POLICY_VIOLATION,
                    "reason": "missing or incorrect API key",
                }
            )
        elif "websocket.http.response" in scope.get("extensions", {}):
            body = json.dumps(
                APIError(
                    401,
                    "missing or incorrect API key: send the header "
                    "`Authorization: Bearer <key>` (browsers: the subprotocol "
                    "`openai-insecure-api-key.<key>`) with the key the server "
                    "was started with (--api-key or OMNI_PD_API_KEY)",
                    code="invalid_api_key",
                ).body.model_dump()
            ).encode()
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                }
            )
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send(
                {
                    "type": "websocket.close",
                    "code": WS_POLICY_VIOLATION,
                    "reason": "missing or incorrect API key",
                }
            )


def wav_base64(audio, sample_rate: int) -> str:
    buffer = io.BytesIO()
    write_wav(buffer, audio, sample_rate)  # the same bytes for the same samples
    return base64.b64encode(buffer.getvalue()).decode()


def pcm16_base64(audio, sample_rate: int, gain: float) -> str:
    return base64.b64encode(pcm16_bytes(audio, sample_rate, gain)).decode()


class ServerState:
    """What the app holds: the orchestrator once it is up, and its metrics."""

    def __init__(self, served_model: str) -> None:
        self.served_model = served_model
        self.omni: AsyncOmni | None = None
        self.startup_error: str | None = None
        self.pcm16_gain = 1.0  # set from the stage config once the stages are up
        self.metrics = ServerMetrics()
        self.admission: AdmissionControl | None = None  # set once the stages are up
        self.realtime_sessions: set[RealtimeSession] = set()  # open /v1/realtime sockets

    def ready_omni(self) -> AsyncOmni:
        """The orchestrator, or a 503 saying why there is none yet."""
        if self.omni is None:
            raise APIError(
                503,
                self.startup_error or "the stages are still starting; retry when GET /health answers 200",
                type="service_unavailable",
            )
        return self.omni

    async def admit(self) -> Slot:
        """A slot in the stages, or (counted as overloaded) the 429 the queue gives."""
        try:
            return await self.admission.enter()
        except APIError:
            self.metrics.requests.labels(outcome="overloaded").inc()
            raise


# Text longer than this many characters per token of context is tokenized only up to that many
# characters at first: more tokens than the context there already refuses the request, after a
# bounded amount of work (tokenizing the 16 MiB a body may hold takes about 20 s of CPU).
PREFIX_CHARS_PER_TOKEN = 64


def _texts(prompt: dict[str, Any]) -> list[str]:
    out = []
    for message in prompt["messages"]:
        content = message["content"]
        if isinstance(content, str):
            out.append(content)
        else:
            out.extend(part["text"] for part in content if part["type"] == "text")
    return out


# Text up to this many characters, with no audio, is prepared on the event loop (~0.1 ms): the
# thread hop costs more under load, where the thread waits for the GIL behind the loop.
INLINE_PREPARE_CHARS = 4096


def _prepare_inline(body: ChatCompletionRequest) -> bool:
    """Whether `body` is short text only, cheaper to prepare on the event loop than in a thread."""
    chars = 0
    for message in body.messages:
        content = message.content
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for part in parts:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                return False  # audio to decode, or a malformed part: the thread reports it
            chars += len(text)
    return chars <= INLINE_PREPARE_CHARS


def _prepare(
    omni: AsyncOmni, body: ChatCompletionRequest, served_model: str
) -> tuple[TranslatedRequest, PreparedPrompt]:
    """The request translated (its audio decoded), its prompt built and its length checked: CPU
    work that runs in a thread, off the event loop (a 20 MB text took 26 s to tokenize on it, and
    the server answered nothing meanwhile, /health included), unless `_prepare_inline`. Checked
    here so a streamed request that cannot fit gets a 400 before its response starts; the built
    prompt goes to the stages."""
    thinker_defaults = omni.stages[omni.text_stage_id].default_sampling_params
    request = translate(body, thinker_defaults, served_model)
    max_tokens, context = request.thinker_params.max_tokens, omni.max_model_len
    texts, cap = _texts(request.prompt), PREFIX_CHARS_PER_TOKEN * context
    if sum(map(len, texts)) > cap:
        # Each text tokenized on its own: in the prompt it is at most a token shorter at either
        # end (where it merges with the chat template's text around it).
        lower_bound = 0
        for text in texts:
            lower_bound += len(omni.tokenizer.encode(text[:cap], add_special_tokens=False)) - 2
            if lower_bound + max_tokens > context:
                raise PromptTooLong.of(lower_bound, max_tokens, context, at_least=True)
    prepared = omni.prepare(request.prompt)
    prompt_len = len(prepared.text_prompt.prompt_token_ids)
    if prompt_len + max_tokens > context:
        raise PromptTooLong.of(prompt_len, max_tokens, context)
    return request, prepared


async def _until_disconnected(http_request: Request) -> None:
    # After the body, uvicorn's receive() blocks until the client goes (or the answer is sent).
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    make_omni: Callable[[], AsyncOmni],
    served_model: str,
    *,
    enable_debug_endpoints: bool = False,
    on_startup_failure: Callable[[], None] | None = None,
    api_key: str | None = None,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    max_queued_requests: int | None = None,
    demo_page: bool = True,
) -> FastAPI:
    """`max_queued_requests`: requests that may wait for the stages (admission.py); None: the
    default, DEFAULT_QUEUE_FACTOR x what the stages admit at once. `demo_page`: serve the voice
    demo page at /demo/ (demo.py)."""
    if max_queued_requests is not None and max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be 0 or more, got {max_queued_requests}")
    state = ServerState(served_model)
    app = FastAPI(
        title="omni-pd", lifespan=_lifespan(state, make_omni, max_queued_requests, on_startup_failure)
    )
    app.state.omni_pd = state
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    _add_error_handlers(app, state)
    _add_info_routes(app, state)
    if enable_debug_endpoints:
        _add_debug_routes(app, state)
    _add_realtime_route(app, state)
    _add_chat_route(app, state)
    if demo_page:
        add_demo_routes(app, state, api_key_required=bool(api_key), realtime_path=REALTIME_PATH)
    return app


# ---- start-up and shutdown ------------------------------------------------------------------
def _admission_for(omni: AsyncOmni, max_queued_requests: int | None) -> AdmissionControl:
    """Every request passes through each stage, so the server admits what its narrowest stage
    does; None queues DEFAULT_QUEUE_FACTOR x that."""
    capacity = min(s.max_num_seqs * s.runtime.num_replicas for s in omni.stages.values())
    queued = max_queued_requests if max_queued_requests is not None else DEFAULT_QUEUE_FACTOR * capacity
    return AdmissionControl(capacity, queued)


async def _start_stages(
    state: ServerState,
    make_omni: Callable[[], AsyncOmni],
    max_queued_requests: int | None,
    on_startup_failure: Callable[[], None] | None,
) -> None:
    """Build the orchestrator off the event loop (the server answers /health meanwhile); a
    failure is kept for /health and handed to `on_startup_failure`."""
    try:
        omni = await asyncio.to_thread(make_omni)
        freeze_startup_heap("server")  # before any request is served: it blocks the loop
        state.omni = omni  # no await until the gain is set: no request sees it unset
        state.pcm16_gain = stage_config_pcm16_gain(omni.stages.values())
        state.metrics.name_stages(omni.health())
        state.admission = _admission_for(omni, max_queued_requests)
        log.info(
            "serving %s: every stage is up; %d requests at once, %d more may wait "
            "(--max-queued-requests), then 429",
            state.served_model,
            state.admission.capacity,
            state.admission.max_queued,
        )
        log.info(
            "pcm16 audio: %d Hz mono int16 after a gain of %g (%s)",
            PCM16_SAMPLE_RATE,
            state.pcm16_gain,
            "the audio stage loads dummy weights, whose waveform is near silent"
            if state.pcm16_gain != 1.0
            else "real weights",
        )
    except Exception as exc:
        state.startup_error = f"{type(exc).__name__}: {exc}"
        log.error("the stages failed to start: %s", state.startup_error)
        if on_startup_failure:
            on_startup_failure()


def _lifespan(
    state: ServerState,
    make_omni: Callable[[], AsyncOmni],
    max_queued_requests: int | None,
    on_startup_failure: Callable[[], None] | None,
):
    """Start the stages in the background as the app starts; stop them as it stops (after a
    start still under way has ended)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(
            _start_stages(state, make_omni, max_queued_requests, on_startup_failure)
        )
        try:
            yield
        finally:
            if not starting.done():
                await asyncio.wait([starting])
            if state.omni is not None:
                await asyncio.to_thread(state.omni.close)
                log.info("all stages stopped")

    return lifespan


# ---- errors in OpenAI's shape ---------------------------------------------------------------
def _count_bad_request(state: ServerState, request: Request) -> None:
    if request.url.path == CHAT_PATH:
        state.metrics.requests.labels(outcome="bad_request").inc()


def _validation_error_message(request: Request, exc: RequestValidationError) -> APIError:
    """pydantic's first complaint about a body, as one 400 naming the field."""
    first = exc.errors()[0] if exc.errors() else {}
    loc, kind = tuple(first.get("loc", ())), first.get("type")
    if kind == "json_invalid":
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return APIError(
            400,
            f"the request body is not valid JSON: {(first.get('ctx') or {}).get('error', '')}{at}",
            code="invalid_json",
        )
    where = _param_path(loc)
    if where is None and kind == "missing":
        message = "the request body is missing: send a JSON object with `model` and `messages`"
    elif where is None:
        content_type = request.headers.get("content-type", "application/json")
        message = "the request body must be a JSON object with `model` and `messages`" + (
            ""
            if "json" in content_type
            else f", sent with Content-Type: application/json, not {content_type!r}"
        )
    else:
        message = f"{where}: {first.get('msg', 'invalid')}"
    return APIError(400, message, param=where)


def _http_error_message(state: ServerState, request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's own errors (unknown URL or method, an unreadable body) in OpenAI's words."""
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 400 and exc.__cause__ is not None:  # the body could not be read
        _count_bad_request(state, request)
        message = (
            f"the request body could not be read as JSON ({type(exc.__cause__).__name__}: "
            f"{exc.__cause__}); send a UTF-8 JSON object"
        )
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
    return APIError(exc.status_code, message, type=kind)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error, ours or the framework's, leaves in OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        _count_bad_request(state, request)
        return _error_response(_validation_error_message(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(_http_error_message(state, request, exc), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):  # Starlette logs it, then re-raises
        return _error_response(APIError(500, f"{type(exc).__name__}: {exc}", type="internal_server_error"))


# ---- /health, /v1/models, /metrics, /debug/state --------------------------------------------
def _add_info_routes(app: FastAPI, state: ServerState) -> None:
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


def _add_debug_routes(app: FastAPI, state: ServerState) -> None:
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


def _add_realtime_route(app: FastAPI, state: ServerState) -> None:
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
            websocket, state.omni, state, state.served_model, lambda exc: _as_api_error(state, exc), beta=beta
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


# ---- /v1/chat/completions -------------------------------------------------------------------
def _add_chat_route(app: FastAPI, state: ServerState) -> None:
    @app.post(CHAT_PATH)
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        omni = state.ready_omni()
        slot = await state.admit()  # before any work: an overloaded server refuses at once
        response = None
        try:
            response = await _serve_chat(state, omni, body, http_request, slot)
            return response
        finally:
            if not isinstance(response, StreamingResponse):  # a stream releases it as it ends
                slot.release()


async def _prepare_checked(
    state: ServerState, omni: AsyncOmni, body: ChatCompletionRequest
) -> tuple[TranslatedRequest, PreparedPrompt]:
    """The request checked, translated and its prompt built; any refusal as an API error."""
    try:
        if body.audio is not None and body.audio.voice.lower() not in omni.pipeline.voices:
            raise APIError(
                400,
                f"voice {body.audio.voice!r} is not available; choose one of {list(omni.pipeline.voices)}",
                param="audio.voice",
            )
        if _prepare_inline(body):
            return _prepare(omni, body, state.served_model)
        return await asyncio.to_thread(_prepare, omni, body, state.served_model)
    except BaseException as exc:
        raise _as_api_error(state, exc) from exc


def _stage_params(omni: AsyncOmni, request: TranslatedRequest) -> list:
    """The request's sampling params for the text stage (and a P/D pair's prefill leg); the
    other stages keep their defaults (None)."""
    return [
        request.thinker_params
        if sid == omni.text_stage_id or (omni.pd_pair and sid == omni.pd_pair.prefill_stage_id)
        else None
        for sid in (s.stage_id for s in omni.config.stages)
    ]


async def _serve_chat(
    state: ServerState, omni: AsyncOmni, body: ChatCompletionRequest, http_request: Request, slot: Slot
):
    request, prepared = await _prepare_checked(state, omni, body)
    params = _stage_params(omni, request)
    completion_id = f"chatcmpl-{secrets.token_hex(12)}"
    created = int(time.time())
    if body.stream:
        events = _stream(
            omni,
            state,
            request,
            prepared,
            params,
            completion_id,
            created,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        # The stream keeps the request's slot until it ends, or is collected unstarted when
        # the client leaves before its first byte.
        streamed = _holding(slot, events)
        slot.release_with(streamed)
        return StreamingResponse(streamed, media_type="text/event-stream")
    output = await _generate_unless_gone(state, omni, request, prepared, params, completion_id, http_request)
    if output is None:
        return Response(status_code=499)  # nobody is there to read it
    state.metrics.requests.labels(outcome="success").inc()
    state.metrics.observe(output.metrics)
    return _completion(state, request, output, completion_id, created)


async def _generate_unless_gone(
    state: ServerState,
    omni: AsyncOmni,
    request: TranslatedRequest,
    prepared: PreparedPrompt,
    params: list,
    completion_id: str,
    http_request: Request,
) -> OmniRequestOutput | None:
    """The whole answer, or None (counted as aborted) when the client leaves before it: then
    the request is aborted so that the stages stop working for nobody."""
    state.metrics.in_flight.inc()
    generation = asyncio.ensure_future(
        omni.generate(prepared, params, request_id=completion_id, modalities=request.modalities)
    )
    client_gone = asyncio.ensure_future(_until_disconnected(http_request))
    try:
        await asyncio.wait([generation, client_gone], return_when=asyncio.FIRST_COMPLETED)
        if not generation.done():  # the client left before its answer: free the stages
            omni.abort(completion_id)
            await asyncio.wait([generation])
            if not generation.cancelled():
                generation.exception()  # retrieved: an aborted request's error is expected
            state.metrics.requests.labels(outcome="aborted").inc()
            return None
        return generation.result()
    except BaseException as exc:
        if not generation.done():  # this handler was cancelled (the server is stopping)
            omni.abort(completion_id)
        raise _as_api_error(state, exc) from exc
    finally:
        client_gone.cancel()
        state.metrics.in_flight.dec()


def _completion(
    state: ServerState,
    request: TranslatedRequest,
    output: OmniRequestOutput,
    completion_id: str,
    created: int,
) -> dict[str, Any]:
    """A non-streamed answer as OpenAI's `chat.completion`, the audio whole in the asked format."""
    message: dict[str, Any] = {"role": "assistant", "content": output.text}
    if output.audio is not None and "audio" in request.modalities:
        if request.audio_format == "pcm16":
            data = pcm16_base64(output.audio, output.sample_rate, state.pcm16_gain)
        else:
            data = wav_base64(output.audio, output.sample_rate)
        message["audio"] = {
            "id": f"audio-{secrets.token_hex(8)}",
            "expires_at": created + AUDIO_EXPIRES_S,
            "data": data,
            "transcript": output.text,
        }
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": state.served_model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": output.finish_reason, "logprobs": None}
        ],
        "usage": _usage(output),
    }


async def _holding(slot: Slot, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        slot.release()


def _usage(output) -> dict[str, Any]:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens`: the prompt tokens whose KV
    came from the prefix cache."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(output.metrics.get("prefix_cached_tokens", 0))},
    }


def _as_api_error(state: ServerState, exc: BaseException) -> BaseException:
    if isinstance(exc, APIError):
        state.metrics.requests.labels(outcome="bad_request").inc()
        return exc
    if isinstance(exc, PromptTooLong):
        state.metrics.requests.labels(outcome="bad_request").inc()
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ValueError):
        state.metrics.requests.labels(outcome="bad_request").inc()
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, (RequestTimeout, StageTimeout)):  # the request's deadline passed
        state.metrics.requests.labels(outcome="timeout").inc()
        return APIError(504, str(exc), type="timeout")
    if isinstance(exc, StageUnavailable):  # restarting or down: nothing was computed
        state.metrics.requests.labels(outcome="unavailable").inc()
        retry = exc.retry_after_s
        return APIError(
            503,
            str(exc),
            type="service_unavailable",
            headers={"retry-after": str(max(1, round(retry)))} if retry else None,
        )
    if isinstance(exc, (RequestAborted, asyncio.CancelledError)):
        state.metrics.requests.labels(outcome="aborted").inc()
        return exc
    state.metrics.requests.labels(outcome="error").inc()
    if isinstance(exc, StageError):
        return APIError(500, str(exc), type="internal_server_error")
    log.exception("request failed", exc_info=exc)
    return APIError(500, f"{type(exc).__name__}: {exc}", type="internal_server_error")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(
    omni: AsyncOmni,
    state: ServerState,
    request: TranslatedRequest,
    prepared: PreparedPrompt,
    params,
    completion_id: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE chunks as OpenAI streams them: text as `delta.content`; each piece of audio as
    `delta.audio` {id, data: base64 pcm16, transcript: the text since the previous piece}; then
    a last `delta.audio` {id, expires_at} (with any text still untranscribed), so no piece of
    audio waits to learn whether it is the last.

    The first chunk leaves with the first text or audio and carries `role`, as vLLM's does:
    clients time the first token from the first chunk (vLLM's `bench serve`), and a role-only
    chunk sent before the prompt has run would read as a first token in a few milliseconds."""

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.served_model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }

    role_sent = False

    def with_role(delta: dict) -> dict:
        nonlocal role_sent
        if role_sent:
            return delta
        role_sent = True
        return {"role": "assistant", **delta}

    audio_id = f"audio-{secrets.token_hex(8)}"
    untranscribed, audio_sent, counted = "", False, False
    state.metrics.in_flight.inc()
    events = omni.stream(prepared, params, request_id=completion_id, modalities=request.modalities)
    try:
        # A client that goes is noticed by starlette's StreamingResponse, which listens for the
        # disconnect while this generator runs and cancels it; `finally` then closes `events`,
        # which aborts the request everywhere. (Polling `is_disconnected()` per event as well
        # cost a tenth of the server process's CPU under load.)
        async for event in events:
            if isinstance(event, TextDelta):
                untranscribed += event.text
                yield _sse(chunk(with_role({"content": event.text})))
            elif isinstance(event, AudioDelta) and event.audio.numel():
                data = pcm16_base64(event.audio, event.sample_rate, state.pcm16_gain)
                yield _sse(
                    chunk(with_role({"audio": {"id": audio_id, "data": data, "transcript": untranscribed}}))
                )
                untranscribed, audio_sent = "", True
            elif isinstance(event, Finished):
                output = event.output
                if audio_sent:
                    last: dict[str, Any] = {"id": audio_id, "expires_at": created + AUDIO_EXPIRES_S}
                    if untranscribed:
                        last["transcript"] = untranscribed
                    yield _sse(chunk({"audio": last}))
                # An answer with nothing to send still opens with the role.
                yield _sse(chunk(with_role({"content": ""}) if not role_sent else {}, output.finish_reason))
                if include_usage:
                    yield _sse(
                        {
                            "id": completion_id,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": state.served_model,
                            "choices": [],
                            "usage": _usage(output),
                        }
                    )
                state.metrics.requests.labels(outcome="success").inc()
                counted = True
                state.metrics.observe(output.metrics)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: report in-band, as vLLM does
        counted = True
        error = _as_api_error(state, exc)
        body = error.body.model_dump() if isinstance(error, APIError) else {"error": {"message": str(exc)}}
        yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        if not counted:  # the client went (a break above, or this generator cancelled / closed)
            state.metrics.requests.labels(outcome="aborted").inc()
        await events.aclose()
        state.metrics.in_flight.dec()
