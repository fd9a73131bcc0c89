"""OpenAI-compatible HTTP server over `AsyncOmni`: /v1/chat/completions (text and speech,
streaming or not), the Realtime API's websocket /v1/realtime (realtime/), /v1/models, /health,
/metrics.

Hostile input: bodies over `max_request_bytes` are refused (413) before they are read, /v1/* needs
`Authorization: Bearer <api_key>` when a key is set (401), every other problem is a 400 in
OpenAI's error shape naming the field, and the CPU work a request brings (decoding its audio,
tokenizing its text) runs off the event loop, so one request cannot stall the others.

This module builds the app and starts and stops the stages; the middleware (key, body limit) is
in middleware.py, the error mapping in errors.py, the chat route in chat.py (streamed:
chat_stream.py; preparing a request: prepare.py), the other routes in routes.py."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI

from ...audio_io import PCM16_SAMPLE_RATE, stage_config_pcm16_gain
from ...orchestrator.async_omni import AsyncOmni
from ...orchestrator.heap import freeze_startup_heap
from .admission import DEFAULT_QUEUE_FACTOR, AdmissionControl
from .chat import add_chat_route
from .chat_stream import AUDIO_FORMS
from .demo import add_demo_routes
from .errors import add_error_handlers
from .middleware import RequestGuard
from .protocol import DEFAULT_MAX_REQUEST_BYTES, REALTIME_PATH
from .routes import add_debug_routes, add_info_routes, add_realtime_route
from .server_state import ServerState

# A chat request's modalities when it names none: OpenAI's default, or vllm-omni's server's (the
# model's outputs; vllm-omni's clients send none).
DEFAULT_MODALITIES = (("text",), ("text", "audio"))

log = logging.getLogger(__name__)


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
    stream_audio_form: str = "openai",
    trace_hops: bool = False,
    default_modalities: tuple[str, ...] = ("text",),
) -> FastAPI:
    """`max_queued_requests`: requests that may wait for the stages (admission.py); None: the
    default, DEFAULT_QUEUE_FACTOR x what the stages admit at once. `demo_page`: serve the voice
    demo page at /demo/ (demo.py). `stream_audio_form`: how streamed chat sends audio
    (chat_stream.AUDIO_FORMS: OpenAI's, or vllm-omni's). `trace_hops`: each chat answer carries
    its request's timeline (hop_trace.py). `default_modalities`: what a chat request that names
    no `modalities` gets: text, as OpenAI answers, or text and audio, as vllm-omni answers."""
    if max_queued_requests is not None and max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be 0 or more, got {max_queued_requests}")
    if stream_audio_form not in AUDIO_FORMS:
        raise ValueError(
            f"--stream-audio-form must be one of {', '.join(AUDIO_FORMS)}, got {stream_audio_form!r}"
        )
    if default_modalities not in DEFAULT_MODALITIES:
        raise ValueError(
            f"--default-modalities must be one of {', '.join(map(','.join, DEFAULT_MODALITIES))}, "
            f"got {','.join(default_modalities)!r}"
        )
    state = ServerState(served_model, stream_audio_form, trace_hops, default_modalities)
    app = FastAPI(
        title="omni-pd", lifespan=_lifespan(state, make_omni, max_queued_requests, on_startup_failure)
    )
    app.state.omni_pd = state
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    add_error_handlers(app, state)
    add_info_routes(app, state)
    if enable_debug_endpoints:
        add_debug_routes(app, state)
    add_realtime_route(app, state)
    add_chat_route(app, state)
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
        state.pcm16_gain = stage_config_pcm16_gain(
            omni.stages.values(), omni.pipeline.dummy_weights_audio_gain
        )
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
