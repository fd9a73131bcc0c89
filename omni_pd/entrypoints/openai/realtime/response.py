"""One Realtime response: the conversation so far through the pipeline, streamed as events.

A `ResponseRun` owns one response's state from `response.create` to `response.done`: its
assistant item, the text and audio it has sent, its admission slot and the request in the
stages. It ends one of four ways, each with one `response.done`: completed (or incomplete, at
max_output_tokens), cancelled (`response.cancel`, or speech that barges in), failed (a stage
error, overload, a prompt past the context), or its socket gone. A cancelled or failed answer
keeps in the conversation only what was sent: for a spoken answer, the transcript of the audio
sent (`ModelPipeline.speech_text`), since that is what the listener heard.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ....audio_io import pcm16_bytes
from ....orchestrator.async_omni import AudioDelta, Finished, TextDelta
from .conversation import Item, Part
from .events import PCM_RATE, new_id, server_event

log = logging.getLogger(__name__)


@dataclass
class ResponseSpec:
    """What one response is asked for: the session's settings with response.create's overrides."""

    modalities: tuple[str, ...]  # ("audio",) or ("text",)
    instructions: str
    voice: str
    max_output_tokens: int | None  # None: "inf" (the thinker stage's default max_tokens)
    metadata: dict[str, str] | None = None

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities


@dataclass
class ResponseRun:
    spec: ResponseSpec
    messages: list[dict[str, Any]]  # the conversation before this response
    id: str = field(default_factory=lambda: new_id("resp"))
    item: Item = field(default_factory=lambda: Item(new_id("item"), "assistant", status="in_progress"))
    text: str = ""  # every text delta sent
    samples_sent: int = 0  # audio samples sent (24 kHz)
    output: Any = None  # the finished output, when it finished
    status: str = "in_progress"
    reason: str | None = None  # cancelled: client_cancelled / turn_detected; incomplete: max_output_tokens
    error: dict[str, str] | None = None
    task: asyncio.Task | None = None
    started: float = field(default_factory=time.perf_counter)

    # ---- the protocol's view ---------------------------------------------------------------
    def public(self, conversation_id: str) -> dict[str, Any]:
        details = None
        if self.status != "in_progress" and self.status != "completed":
            details = {"type": self.status, "reason": self.reason, "error": self.error}
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": self.status,
            "status_details": details,
            "conversation_id": conversation_id,
            "output": [self.item.public()] if self.status != "in_progress" else [],
            "output_modalities": list(self.spec.modalities),
            "max_output_tokens": self.spec.max_output_tokens or "inf",
            "audio": {
                "output": {"format": {"type": "audio/pcm", "rate": PCM_RATE}, "voice": self.spec.voice}
            },
            "metadata": self.spec.metadata,
            "usage": self.usage(),
        }

    def usage(self) -> dict[str, Any] | None:
        if self.output is None:
            return None
        prompt, completion = len(self.output.prompt_token_ids), len(self.output.token_ids)
        cached = int(self.output.metrics.get("prefix_cached_tokens", 0))
        return {
            "total_tokens": prompt + completion,
            "input_tokens": prompt,
            "output_tokens": completion,
            "input_token_details": {"cached_tokens": cached},
            "output_token_details": {"text_tokens": completion},
        }

    def ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def heard_text(self, speech_text: Callable[[str, float], str] | None) -> str:
        """The answer as far as it was sent: its text, or for speech, what the audio sent says."""
        if not self.spec.audio or self.status == "completed" or self.status == "incomplete":
            return self.text
        if speech_text is None:
            return ""
        return speech_text(self.text, self.samples_sent / PCM_RATE)


Send = Callable[[dict[str, Any]], Awaitable[None]]


async def stream_response(
    run: ResponseRun, omni, state, send: Send, prepare: Callable[[ResponseRun], Any], inline: bool = False
) -> None:
    """Run `run` through the stages, sending its deltas; sets its status and output. Raises what
    the stages raise (the caller sends response.done); CancelledError when it is cancelled.
    `prepare` (tokenizing, audio features) runs in a thread unless `inline`."""
    slot = await state.admission.enter()
    try:
        prepared, params = prepare(run) if inline else await asyncio.to_thread(prepare, run)
        modalities = ("text", "audio") if run.spec.audio else ("text",)
        state.metrics.in_flight.inc()
        events = omni.stream(prepared, params, request_id=run.id, modalities=modalities)
        try:
            async for event in events:
                if isinstance(event, TextDelta) and event.text:
                    run.text += event.text
                    kind = (
                        "response.output_audio_transcript.delta"
                        if run.spec.audio
                        else "response.output_text.delta"
                    )
                    await send(server_event(kind, **run.ids(), delta=event.text))
                elif isinstance(event, AudioDelta) and run.spec.audio and event.audio.numel():
                    data = pcm16_bytes(event.audio, event.sample_rate, state.pcm16_gain)
                    run.samples_sent += event.audio.numel()
                    await send(
                        server_event(
                            "response.output_audio.delta", **run.ids(), delta=base64.b64encode(data).decode()
                        )
                    )
                elif isinstance(event, Finished):
                    run.output = event.output
        finally:
            await events.aclose()  # an early end (cancel, a send that failed) aborts the stages
            state.metrics.in_flight.dec()
    finally:
        slot.release()
    run.status = "incomplete" if run.output.finish_reason == "length" else "completed"
    run.reason = "max_output_tokens" if run.status == "incomplete" else None
    state.metrics.observe(run.output.metrics)


async def finish_response(
    run: ResponseRun, conversation_id: str, send: Send, speech_text: Callable[[str, float], str] | None
) -> None:
    """The events that close a response, whatever its status: the text or audio done, the
    item as it stays in the conversation, response.done."""
    text = run.heard_text(speech_text)
    ids = run.ids()
    if run.spec.audio:
        part = Part(
            "output_audio",
            transcript=text,
            audio_ms=run.samples_sent * 1000 // PCM_RATE,
            spoken_text=run.text,
        )
        await send(server_event("response.output_audio.done", **ids))
        await send(server_event("response.output_audio_transcript.done", **ids, transcript=text))
        await send(
            server_event("response.content_part.done", **ids, part={"type": "audio", "transcript": text})
        )
    else:
        part = Part("output_text", text=text)
        await send(server_event("response.output_text.done", **ids, text=text))
        await send(server_event("response.content_part.done", **ids, part={"type": "text", "text": text}))
    run.item.parts = [part]
    run.item.status = "completed" if run.status == "completed" else "incomplete"
    await send(
        server_event("response.output_item.done", response_id=run.id, output_index=0, item=run.item.public())
    )
    await send(server_event("conversation.item.done", item=run.item.public()))
    await send(server_event("response.done", response=run.public(conversation_id)))
    log.debug(
        "realtime response %s %s after %.0f ms, %d samples of audio sent",
        run.id,
        run.status,
        (time.perf_counter() - run.started) * 1e3,
        run.samples_sent,
    )
