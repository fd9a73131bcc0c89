"""OpenAI-compatible HTTP server over `AsyncOmni`: /v1/chat/completions (text and speech,
streaming or not), /v1/models, /health, /metrics."""
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

import soundfile
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...audio_io import PCM16_SAMPLE_RATE, pcm16_bytes, stage_config_pcm16_gain
from ...orchestrator.async_omni import (AsyncOmni, AudioDelta, Finished, PromptTooLong,
                                        RequestAborted, RequestTimeout, TextDelta)
from ...orchestrator.stage_client import StageError, StageTimeout
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest
from .translate import TranslatedRequest, translate

log = logging.getLogger(__name__)
AUDIO_EXPIRES_S = 3600  # `expires_at`: OpenAI's audio ids expire; omni-pd keeps no audio at all


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status)


def wav_base64(audio, sample_rate: int) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, audio.numpy(), sample_rate, format="WAV", subtype="FLOAT")
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


def create_app(make_omni: Callable[[], AsyncOmni], served_model: str, *,
               enable_debug_endpoints: bool = False, on_startup_failure: Callable[[], None] | None = None
               ) -> FastAPI:
    state = ServerState(served_model)

    async def start_stages() -> None:
        try:
            omni = await asyncio.to_thread(make_omni)
            state.omni = omni  # no await until the gain is set: no request sees it unset
            state.pcm16_gain = stage_config_pcm16_gain(omni.stages.values())
            log.info("serving %s: every stage is up", served_model)
            log.info("pcm16 audio: %d Hz mono int16 after a gain of %g (%s)", PCM16_SAMPLE_RATE,
                     state.pcm16_gain, "the audio stage loads dummy weights, whose waveform is "
                     "near silent" if state.pcm16_gain != 1.0 else "real weights")
        except Exception as exc:
            state.startup_error = f"{type(exc).__name__}: {exc}"
            log.error("the stages failed to start: %s", state.startup_error)
            if on_startup_failure:
                on_startup_failure()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(start_stages())
        try:
            yield
        finally:
            if not starting.done():
                await asyncio.wait([starting])
            if state.omni is not None:
                await asyncio.to_thread(state.omni.close)
                log.info("all stages stopped")

    app = FastAPI(title="omni-pd", lifespan=lifespan)
    app.state.omni_pd = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON: "
                                            f"{first.get('msg', '')}", code="invalid_json"))
        return _error_response(APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid')}",
                                        param=where))

    def ready_omni() -> AsyncOmni:
        if state.omni is None:
            raise APIError(503, state.startup_error or "the stages are still starting; retry when "
                           "GET /health answers 200", type="service_unavailable")
        return state.omni

    @app.get("/health")
    async def health():
        if state.omni is None:
            return JSONResponse({"status": "failed" if state.startup_error else "starting",
                                 "error": state.startup_error}, status_code=503)
        return {"status": "ok", "stages": len(state.omni.clients)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model, "object": "model",
                                            "created": 0, "owned_by": "omni-pd"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(state.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    if enable_debug_endpoints:
        @app.get("/debug/state")
        async def debug_state():
            omni = ready_omni()
            return {"counts": await omni.debug_state_counts(), "worker_pids": omni.worker_pids}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        omni = ready_omni()
        thinker_defaults = omni.stages[omni.text_stage_id].default_sampling_params
        if body.audio is not None and body.audio.voice.lower() not in omni.pipeline.voices:
            raise APIError(400, f"voice {body.audio.voice!r} is not available; choose one of "
                           f"{list(omni.pipeline.voices)}", param="audio.voice")
        request = translate(body, thinker_defaults, served_model)
        params = [request.thinker_params if sid == omni.text_stage_id or
                  (omni.pd_pair and sid == omni.pd_pair.prefill_stage_id) else None
                  for sid in (s.stage_id for s in omni.config.stages)]
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(
                _stream(omni, state, request, params, completion_id, created, http_request,
                        include_usage=bool(body.stream_options and body.stream_options.include_usage)),
                media_type="text/event-stream")
        state.metrics.in_flight.inc()
        try:
            output = await omni.generate(request.prompt, params, request_id=completion_id,
                                         modalities=request.modalities)
        except BaseException as exc:
            raise _as_api_error(state, exc) from exc
        finally:
            state.metrics.in_flight.dec()
        state.metrics.requests.labels(outcome="success").inc()
        state.metrics.observe(output.metrics)
        message: dict[str, Any] = {"role": "assistant", "content": output.text}
        if output.audio is not None and "audio" in request.modalities:
            if request.audio_format == "pcm16":
                data = pcm16_base64(output.audio, output.sample_rate, state.pcm16_gain)
            else:
                data = wav_base64(output.audio, output.sample_rate)
            message["audio"] = {"id": f"audio-{secrets.token_hex(8)}",
                                "expires_at": created + AUDIO_EXPIRES_S, "data": data,
                                "transcript": output.text}
        return {"id": completion_id, "object": "chat.completion", "created": created,
                "model": served_model,
                "choices": [{"index": 0, "message": message, "finish_reason": output.finish_reason,
                             "logprobs": None}],
                "usage": _usage(output)}

    return app


def _usage(output) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


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


async def _stream(omni: AsyncOmni, state: ServerState, request: TranslatedRequest, params,
                  completion_id: str, created: int, http_request: Request, include_usage: bool
                  ) -> AsyncIterator[str]:
    """SSE chunks as OpenAI streams them: text as `delta.content`; each piece of audio as
    `delta.audio` {id, data: base64 pcm16, transcript: the text since the previous piece}; then
    a last `delta.audio` {id, expires_at} (with any text still untranscribed), so no piece of
    audio waits to learn whether it is the last."""
    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                "model": state.served_model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    audio_id = f"audio-{secrets.token_hex(8)}"
    untranscribed, audio_sent = "", False
    state.metrics.in_flight.inc()
    events = omni.stream(request.prompt, params, request_id=completion_id,
                         modalities=request.modalities)
    try:
        yield _sse(chunk({"role": "assistant", "content": ""}))
        async for event in events:
            if await http_request.is_disconnected():
                break  # closing `events` below aborts the request everywhere
            if isinstance(event, TextDelta):
                untranscribed += event.text
                yield _sse(chunk({"content": event.text}))
            elif isinstance(event, AudioDelta) and event.audio.numel():
                data = pcm16_base64(event.audio, event.sample_rate, state.pcm16_gain)
                yield _sse(chunk({"audio": {"id": audio_id, "data": data,
                                            "transcript": untranscribed}}))
                untranscribed, audio_sent = "", True
            elif isinstance(event, Finished):
                output = event.output
                if audio_sent:
                    last: dict[str, Any] = {"id": audio_id, "expires_at": created + AUDIO_EXPIRES_S}
                    if untranscribed:
                        last["transcript"] = untranscribed
                    yield _sse(chunk({"audio": last}))
                yield _sse(chunk({}, output.finish_reason))
                if include_usage:
                    yield _sse({"id": completion_id, "object": "chat.completion.chunk",
                                "created": created, "model": state.served_model, "choices": [],
                                "usage": _usage(output)})
                state.metrics.requests.labels(outcome="success").inc()
                state.metrics.observe(output.metrics)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: report in-band, as vLLM does
        error = _as_api_error(state, exc)
        body = error.body.model_dump() if isinstance(error, APIError) else {"error": {"message": str(exc)}}
        yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()
        state.metrics.in_flight.dec()
