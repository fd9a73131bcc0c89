"""/v1/chat/completions: admission, the request prepared, then the whole answer as
`chat.completion` or the streamed one (chat_stream.py)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ...orchestrator.async_omni import AsyncOmni, PreparedPrompt
from ...orchestrator.outputs import OmniRequestOutput
from .admission import Slot
from .chat_stream import stream_chat
from .completion_parts import AUDIO_EXPIRES_S, pcm16_base64, usage, wav_base64
from .errors import as_api_error
from .hop_trace import KEY as TRACE_KEY
from .hop_trace import HopTrace, arrival
from .prepare import prepare_checked
from .protocol import CHAT_PATH, ChatCompletionRequest
from .server_state import ServerState
from .translate import TranslatedRequest


async def _until_disconnected(http_request: Request) -> None:
    # After the body, uvicorn's receive() blocks until the client goes (or the answer is sent).
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def add_chat_route(app: FastAPI, state: ServerState) -> None:
    @app.post(CHAT_PATH)
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        trace = HopTrace(arrival(http_request.state), publish=state.trace_hops)
        omni = state.ready_omni()
        slot = await state.admit()  # before any work: an overloaded server refuses at once
        response = None
        try:
            response = await _serve_chat(state, omni, body, http_request, slot, trace)
            return response
        finally:
            if not isinstance(response, StreamingResponse):  # a stream releases it as it ends
                slot.release()


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
    state: ServerState,
    omni: AsyncOmni,
    body: ChatCompletionRequest,
    http_request: Request,
    slot: Slot,
    trace: HopTrace,
):
    request, prepared = await prepare_checked(state, omni, body)
    trace.hop("prompt prepared")  # translated, chat template applied, tokenized
    params = _stage_params(omni, request)
    completion_id = f"chatcmpl-{secrets.token_hex(12)}"
    created = int(time.time())
    if body.stream:
        events = stream_chat(
            omni,
            state,
            request,
            prepared,
            params,
            completion_id,
            created,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            trace=trace,
            continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
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
    state.metrics.observe(output.metrics, ttft_ms=trace.ttft_ms(output.metrics))
    answer = _completion(state, request, output, completion_id, created)
    if trace.publish:
        trace.hop("answer out")
        answer[TRACE_KEY] = trace.timeline(output.metrics)
    return answer


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
        raise as_api_error(state, exc) from exc
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
        "usage": usage(output),
    }


async def _holding(slot: Slot, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        slot.release()
