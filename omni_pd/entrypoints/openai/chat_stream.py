"""A streamed chat completion: OpenAI's SSE chunks, text and audio interleaved as the stages
produce them."""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator

from ...orchestrator.async_omni import AsyncOmni, AudioDelta, Finished, PreparedPrompt, TextDelta
from .completion_parts import AUDIO_EXPIRES_S, pcm16_base64, usage
from .errors import as_api_error
from .protocol import APIError
from .server_state import ServerState
from .translate import TranslatedRequest


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def stream_chat(
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
                            "usage": usage(output),
                        }
                    )
                state.metrics.requests.labels(outcome="success").inc()
                counted = True
                state.metrics.observe(output.metrics)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: report in-band, as vLLM does
        counted = True
        error = as_api_error(state, exc)
        body = error.body.model_dump() if isinstance(error, APIError) else {"error": {"message": str(exc)}}
        yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        if not counted:  # the client went (a break above, or this generator cancelled / closed)
            state.metrics.requests.labels(outcome="aborted").inc()
        await events.aclose()
        state.metrics.in_flight.dec()
