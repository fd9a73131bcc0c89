"""A streamed chat completion: OpenAI's SSE chunks, text and audio interleaved as the stages
produce them.

Every chunk carries a top-level `modality` ("text" or "audio"), as vllm-omni's server sends it:
vllm-omni's streaming clients (its `vllm bench serve --omni --backend openai-chat-omni`) sort
chunks by it, and OpenAI's clients ignore a key they do not know. Audio goes in one of two forms
(`omni-pd serve --stream-audio-form`): OpenAI's (`delta.audio` with base64 pcm16, the default),
or vllm-omni's (`delta.content` with a base64 16-bit WAV per chunk and the choice's
`audio_metadata`)."""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator, Iterator

from ...orchestrator.async_omni import AsyncOmni, AudioDelta, Finished, PreparedPrompt, TextDelta
from ...orchestrator.outputs import OmniRequestOutput
from .completion_parts import AUDIO_EXPIRES_S, pcm16_base64, pcm16_wav_base64, usage
from .errors import as_api_error
from .hop_trace import KEY as TRACE_KEY
from .hop_trace import HopTrace
from .protocol import APIError
from .server_state import ServerState
from .translate import TranslatedRequest


AUDIO_FORMS = ("openai", "vllm-omni")  # how streamed audio is sent (the module docstring)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _ChunkStream:
    """One streamed completion's SSE chunks in OpenAI's shape: the role on the first chunk, its
    audio pieces under one id, each with the text since the previous piece as its transcript
    (in vllm-omni's audio form: each piece a WAV in `delta.content`, no transcript)."""

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        audio_form: str = "openai",
        prompt_tokens: int | None = None,
    ) -> None:
        """`prompt_tokens`: given, every chunk carries the usage so far (vLLM's
        `stream_options.continuous_usage_stats`)."""
        if audio_form not in AUDIO_FORMS:
            raise ValueError(f"the stream's audio form must be one of {AUDIO_FORMS}, got {audio_form!r}")
        self.completion_id, self.created, self.model = completion_id, created, model
        self.audio_form = audio_form
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        self.role_sent = False
        self.audio_id = f"audio-{secrets.token_hex(8)}"
        self.untranscribed, self.audio_sent = "", False

    def _chunk(
        self,
        delta: dict,
        finish_reason: str | None = None,
        modality: str = "text",
        top: dict[str, Any] | None = None,
        **choice: Any,
    ) -> str:
        payload = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **choice}],
            "modality": modality,
            **(top or {}),
        }
        if self.prompt_tokens is not None:
            payload["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            }
        return _sse(payload)

    def _with_role(self, delta: dict) -> dict:
        if self.role_sent:
            return delta
        self.role_sent = True
        return {"role": "assistant", **delta}

    def text(self, text: str, tokens: int = 0) -> str:
        """A text chunk: `text` and the generated tokens it covers."""
        self.untranscribed += text
        self.completion_tokens += tokens
        return self._chunk(self._with_role({"content": text}))

    def audio(self, delta: AudioDelta, pcm16_gain: float) -> str:
        if self.audio_form == "vllm-omni":
            self.audio_sent = True
            metadata = {
                "format": "wav",
                "sample_rate_hz": int(delta.sample_rate),
                "frame_count": int(delta.audio.numel()),
                "channels": 1,
            }
            wav = pcm16_wav_base64(delta.audio, delta.sample_rate, pcm16_gain)
            return self._chunk(self._with_role({"content": wav}), modality="audio", audio_metadata=metadata)
        data = pcm16_base64(delta.audio, delta.sample_rate, pcm16_gain)
        audio = {"id": self.audio_id, "data": data, "transcript": self.untranscribed}
        self.untranscribed, self.audio_sent = "", True
        return self._chunk(self._with_role({"audio": audio}), modality="audio")

    def finished(
        self, output: OmniRequestOutput, include_usage: bool, trace: HopTrace | None = None
    ) -> Iterator[str]:
        """The last chunks: the audio's end (with the text it has not transcribed), the finish
        reason (with the request's timeline when traced), and the usage when asked for."""
        if self.audio_sent and self.audio_form == "openai":
            last: dict[str, Any] = {"id": self.audio_id, "expires_at": self.created + AUDIO_EXPIRES_S}
            if self.untranscribed:
                last["transcript"] = self.untranscribed
            yield self._chunk({"audio": last}, modality="audio")
        # An answer with nothing to send still opens with the role.
        top: dict[str, Any] = {}
        if trace is not None and trace.publish:
            trace.hop("last chunk out")
            top[TRACE_KEY] = trace.timeline(output.metrics)
        yield self._chunk(
            self._with_role({"content": ""}) if not self.role_sent else {}, output.finish_reason, top=top
        )
        if include_usage:
            yield _sse(
                {
                    "id": self.completion_id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage(output),
                    "modality": "text",
                }
            )


async def stream_chat(
    omni: AsyncOmni,
    state: ServerState,
    request: TranslatedRequest,
    prepared: PreparedPrompt,
    params,
    completion_id: str,
    created: int,
    include_usage: bool,
    trace: HopTrace | None = None,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """SSE chunks as OpenAI streams them: text as `delta.content`; each piece of audio as
    `delta.audio` {id, data: base64 pcm16, transcript: the text since the previous piece}; then
    a last `delta.audio` {id, expires_at} (with any text still untranscribed), so no piece of
    audio waits to learn whether it is the last. With `continuous_usage` (vLLM's
    `stream_options.continuous_usage_stats`) every chunk carries the usage so far.

    The first chunk leaves with the first token (its content "" while the detokenizer holds the
    text back: half a UTF-8 character, a possible stop string) and carries `role`, as vLLM's
    does; after that each step's tokens send a chunk. Clients time the first token from the
    first chunk (vLLM's `bench serve`); no chunk leaves before the prompt has run."""
    prompt_tokens = len(prepared.text_prompt.prompt_token_ids) if continuous_usage else None
    chunks = _ChunkStream(completion_id, created, state.served_model, state.stream_audio_form, prompt_tokens)
    counted = False
    state.metrics.in_flight.inc()
    events = omni.stream(prepared, params, request_id=completion_id, modalities=request.modalities)
    try:
        # A client that goes is noticed by starlette's StreamingResponse, which listens for the
        # disconnect while this generator runs and cancels it; `finally` then closes `events`,
        # which aborts the request everywhere. (Polling `is_disconnected()` per event as well
        # cost a tenth of the server process's CPU under load.)
        async for event in events:
            if isinstance(event, TextDelta):
                chunk = chunks.text(event.text, event.tokens)
                if trace is not None:
                    trace.hop("first chunk out")  # the server's TTFT ends here
                yield chunk
            elif isinstance(event, AudioDelta) and event.audio.numel():
                yield chunks.audio(event, state.pcm16_gain)
            elif isinstance(event, Finished):
                output = event.output
                for line in chunks.finished(output, include_usage, trace):
                    yield line
                state.metrics.requests.labels(outcome="success").inc()
                counted = True
                state.metrics.observe(
                    output.metrics, ttft_ms=trace.ttft_ms(output.metrics) if trace is not None else None
                )
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
