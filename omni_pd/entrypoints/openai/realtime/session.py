"""One Realtime websocket session (`GET /v1/realtime`): its settings, its conversation, its
input audio buffer and turn detector, and at most one running response.

All of a session's state lives in its `RealtimeSession`, from the socket's accept to its close;
closing (or losing) the socket cancels the running response, which aborts its request in every
stage, and the session object is then dropped by the server (`ServerState.realtime_sessions`).
Client events are handled in order, one at a time; a response streams from its own task, and
all sends go through one lock, so events never interleave mid-message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from ....orchestrator.async_omni import PromptTooLong
from .audio import decode_pcm16, duration_ms, pcm16_to_model_rate
from .conversation import Conversation, Item, Part, item_from_client
from .events import (
    PCM_RATE,
    BufferAppend,
    BufferClear,
    BufferCommit,
    ItemCreate,
    ItemDelete,
    ItemTruncate,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    ServerVad,
    SessionConfig,
    SessionUpdate,
    beta_event,
    error_event,
    new_id,
    parse_client_event,
    server_event,
)
from .response import ResponseRun, ResponseSpec, finish_response, stream_response
from .vad import TurnDetector

log = logging.getLogger(__name__)

# Text-only work this small (building an item, tokenizing a prompt of at most this many
# characters) runs on the event loop: a thread hop costs more under load, as in the chat path.
INLINE_CHARS = 4096
# The input audio buffer holds at most this much (about 5.8 MB of pcm16): an append past it is
# refused, and the buffer is kept.
MAX_BUFFER_MS = 120_000
BYTES_PER_MS = PCM_RATE * 2 // 1000


class RealtimeSession:
    def __init__(
        self,
        websocket,
        omni,
        state,
        served_model: str,
        error_of: Callable[[BaseException], BaseException],
        beta: bool = False,
    ):
        self.ws, self.omni, self.state, self.served_model = websocket, omni, state, served_model
        self.beta = beta  # the client asked for the beta protocol (OpenAI-Beta: realtime=v1)
        self.error_of = error_of  # a stage exception -> an APIError (or the exception), counted
        self.id = new_id("sess")
        self.conversation_id = new_id("conv")
        self.conversation = Conversation()
        voices = omni.pipeline.voices
        self.modalities: tuple[str, ...] = ("audio",)
        self.instructions = ""
        self.voice = "ethan" if "ethan" in voices else (voices[0] if voices else "")
        self.max_output_tokens: int | None = None
        self.turn_detection: ServerVad | None = ServerVad(type="server_vad")  # OpenAI's default
        self.detector: TurnDetector | None = TurnDetector(self.turn_detection)
        self.vad_origin_ms = 0  # session audio time where the detector started
        self.buffer = bytearray()
        self.buffer_origin_ms = 0  # session audio time of the buffer's first sample
        self.audio_ms = 0.0  # input audio appended in the session, in ms
        self.speech_item_id: str | None = None  # the item the speech being heard will become
        self.speech_start_ms = 0
        self.response: ResponseRun | None = None
        self._send_lock = asyncio.Lock()
        self.closed = False

    # ---- the socket ----------------------------------------------------------------------------
    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        if self.beta:
            event = beta_event(event)
            if event is None:
                return
        try:
            async with self._send_lock:
                await self.ws.send_text(json.dumps(event))
        except Exception:  # noqa: BLE001 - the client went; the receive loop sees it and ends
            self.closed = True

    async def run(self) -> None:
        await self.send(server_event("session.created", session=self.public()))
        await self.send(
            server_event(
                "conversation.created",
                conversation={"id": self.conversation_id, "object": "realtime.conversation"},
            )
        )
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                data = data if data is not None else message.get("bytes")
                try:
                    await self.handle(parse_client_event(data))
                except RealtimeError as exc:
                    await self.send(error_event(exc))
        finally:
            self.closed = True
            await self.cancel_response("client_cancelled")

    async def handle(self, event) -> None:
        try:
            handler = {
                SessionUpdate: self.update,
                ItemCreate: self.create_item,
                ItemTruncate: self.truncate_item,
                ItemDelete: self.delete_item,
                BufferAppend: self.append,
                BufferCommit: self.commit,
                BufferClear: self.clear,
                ResponseCreate: self.create_response,
                ResponseCancel: self.cancel,
            }[type(event)]
            await handler(event)
        except RealtimeError as exc:
            exc.event_id = exc.event_id or event.event_id
            raise

    # ---- session settings ------------------------------------------------------------------------
    def public(self) -> dict[str, Any]:
        vad = self.turn_detection.model_dump() if self.turn_detection else None
        beta = (
            {
                "modalities": ["text", "audio"] if "audio" in self.modalities else ["text"],
                "voice": self.voice,
                "turn_detection": vad,
                "input_audio_format": "pcm16",
                "output_audio_format": "pcm16",
            }
            if self.beta
            else {}
        )
        return {
            **beta,
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.served_model,
            "output_modalities": list(self.modalities),
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens or "inf",
            "tools": [],
            "tool_choice": "auto",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": PCM_RATE},
                    "turn_detection": vad,
                    "transcription": None,
                    "noise_reduction": None,
                },
                "output": {
                    "format": {"type": "audio/pcm", "rate": PCM_RATE},
                    "voice": self.voice,
                    "speed": 1.0,
                },
            },
        }

    def _voice(self, voice: str | None, param: str) -> str | None:
        if voice is not None and voice not in self.omni.pipeline.voices:
            raise RealtimeError(
                f"voice {voice!r} is not available; choose one of {list(self.omni.pipeline.voices)}",
                param=param,
            )
        return voice

    @staticmethod
    def _modalities(chosen: list[str] | None, beta: list[str] | None) -> tuple[str, ...] | None:
        if chosen:
            return tuple(chosen)
        if beta:  # beta sessions list text with audio; audio always comes with its transcript
            return ("audio",) if "audio" in beta else ("text",)
        return None

    async def update(self, event: SessionUpdate) -> None:
        config: SessionConfig = event.session
        if config.model is not None and config.model != self.served_model:
            raise RealtimeError(
                f"this server serves {self.served_model!r}, not {config.model!r}",
                param="session.model",
                code="model_not_found",
            )
        audio = config.audio
        voice = self._voice(
            audio.output.voice if audio and audio.output else None, "session.audio.output.voice"
        ) or self._voice(config.voice, "session.voice")
        if (
            config.max_output_tokens is not None
            and config.max_output_tokens != "inf"
            and config.max_output_tokens < 1
        ):
            raise RealtimeError(
                'max_output_tokens must be at least 1, or "inf"', param="session.max_output_tokens"
            )
        # Everything checked: apply.
        self.modalities = self._modalities(config.output_modalities, config.modalities) or self.modalities
        if config.instructions is not None:
            self.instructions = config.instructions
        if voice:
            self.voice = voice
        if config.max_output_tokens is not None:
            self.max_output_tokens = None if config.max_output_tokens == "inf" else config.max_output_tokens
        given = (
            audio is not None and audio.input is not None and "turn_detection" in audio.input.model_fields_set
        )
        if given or "turn_detection" in config.model_fields_set:
            self.turn_detection = audio.input.turn_detection if given else config.turn_detection
            self.detector = TurnDetector(self.turn_detection) if self.turn_detection else None
            self.vad_origin_ms, self.speech_item_id = int(self.audio_ms), None
        await self.send(server_event("session.updated", session=self.public()))

    # ---- conversation items ----------------------------------------------------------------------
    async def _add_item(self, item: Item, previous_item_id: str | None = None) -> None:
        previous = self.conversation.add(item, previous_item_id)
        await self.send(
            server_event("conversation.item.added", previous_item_id=previous, item=item.public())
        )
        await self.send(server_event("conversation.item.done", previous_item_id=previous, item=item.public()))

    async def create_item(self, event: ItemCreate) -> None:
        if any(part.audio for part in event.item.content):  # decoding and resampling: a thread
            item = await asyncio.to_thread(item_from_client, event.item)
        else:
            item = item_from_client(event.item)
        await self._add_item(item, event.previous_item_id)

    async def delete_item(self, event: ItemDelete) -> None:
        if self.response and self.response.item.id == event.item_id:
            raise RealtimeError("that item is the running response's; cancel it first", param="item_id")
        self.conversation.delete(event.item_id)
        await self.send(server_event("conversation.item.deleted", item_id=event.item_id))

    async def truncate_item(self, event: ItemTruncate) -> None:
        """The client played only `audio_end_ms` of an assistant's audio: keep the transcript
        of that much, as the next turns' history."""
        item = self.conversation.find(event.item_id)
        if (
            item.role != "assistant"
            or event.content_index >= len(item.parts)
            or item.parts[event.content_index].type != "output_audio"
        ):
            raise RealtimeError(
                "only an assistant item's output_audio part can be truncated", param="content_index"
            )
        if self.response and self.response.item is item:
            raise RealtimeError("that item is still being spoken; cancel the response first", param="item_id")
        part = item.parts[event.content_index]
        if event.audio_end_ms > part.audio_ms:
            raise RealtimeError(
                f"audio_end_ms {event.audio_end_ms} is past the item's audio ({part.audio_ms} ms)",
                param="audio_end_ms",
            )
        cut = self.omni.pipeline.speech_text
        part.transcript = cut(part.spoken_text, event.audio_end_ms / 1000) if cut else ""
        part.audio_ms = event.audio_end_ms
        await self.send(
            server_event(
                "conversation.item.truncated",
                item_id=item.id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        )

    # ---- the input audio buffer ------------------------------------------------------------------
    async def append(self, event: BufferAppend) -> None:
        pcm = decode_pcm16(event.audio)
        if len(self.buffer) + len(pcm) > MAX_BUFFER_MS * BYTES_PER_MS:
            raise RealtimeError(
                f"the input audio buffer would hold over {MAX_BUFFER_MS // 1000} s of audio; "
                "commit (or clear) it more often, or let server_vad commit each turn",
                param="audio",
                code="input_audio_buffer_too_large",
            )
        self.buffer += pcm
        self.audio_ms += len(pcm) / BYTES_PER_MS
        if self.detector is not None:
            for vad in self.detector.feed(pcm):
                await self._turn_event(vad.kind, self.vad_origin_ms + vad.at_ms)

    async def _turn_event(self, kind: str, at_ms: int) -> None:
        if kind == "speech_started":
            self.speech_item_id, self.speech_start_ms = new_id("item"), at_ms
            await self.send(
                server_event(
                    "input_audio_buffer.speech_started", audio_start_ms=at_ms, item_id=self.speech_item_id
                )
            )
            if self.response is not None and self.turn_detection.interrupt_response:
                await self.cancel_response("turn_detected")  # barge-in
            return
        item_id = self.speech_item_id or new_id("item")
        await self.send(
            server_event("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=item_id)
        )
        start = max(0, (self.speech_start_ms - self.buffer_origin_ms) * BYTES_PER_MS)
        self.speech_item_id = None
        await self._commit(item_id, bytes(self.buffer[start:]))
        if self.turn_detection.create_response and self.response is None:
            await self._start_response(self._spec(None))

    async def commit(self, event: BufferCommit) -> None:
        if len(self.buffer) < 100 * BYTES_PER_MS:
            raise RealtimeError(
                f"the input audio buffer holds {len(self.buffer) // BYTES_PER_MS} "
                "ms of audio; commit at least 100 ms",
                param="audio",
                code="input_audio_buffer_commit_empty",
            )
        await self._commit(self.speech_item_id or new_id("item"), bytes(self.buffer))
        self.speech_item_id = None

    async def _commit(self, item_id: str, pcm: bytes) -> None:
        self.buffer.clear()
        self.buffer_origin_ms = int(self.audio_ms)
        audio = await asyncio.to_thread(pcm16_to_model_rate, pcm)
        item = Item(item_id, "user", [Part("input_audio", audio=audio, audio_ms=duration_ms(pcm))])
        previous = self.conversation.items[-1].id if self.conversation.items else None
        await self.send(
            server_event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        )
        await self._add_item(item)

    async def clear(self, event: BufferClear) -> None:
        self.buffer.clear()
        self.buffer_origin_ms = int(self.audio_ms)
        await self.send(server_event("input_audio_buffer.cleared"))

    # ---- responses -------------------------------------------------------------------------------
    def _spec(self, event: ResponseCreate | None) -> ResponseSpec:
        spec = ResponseSpec(self.modalities, self.instructions, self.voice, self.max_output_tokens)
        config = event.response if event else None
        if config is None:
            return spec
        spec.modalities = self._modalities(config.output_modalities, config.modalities) or spec.modalities
        if config.instructions is not None:
            spec.instructions = config.instructions
        voice = self._voice(
            config.audio.output.voice if config.audio and config.audio.output else None,
            "response.audio.output.voice",
        ) or self._voice(config.voice, "response.voice")
        spec.voice = voice or spec.voice
        if config.max_output_tokens is not None:
            if config.max_output_tokens != "inf" and config.max_output_tokens < 1:
                raise RealtimeError(
                    'max_output_tokens must be at least 1, or "inf"', param="response.max_output_tokens"
                )
            spec.max_output_tokens = None if config.max_output_tokens == "inf" else config.max_output_tokens
        spec.metadata = config.metadata
        return spec

    async def create_response(self, event: ResponseCreate) -> None:
        if self.response is not None:
            raise RealtimeError(
                f"response {self.response.id} is still running; cancel it or wait for its response.done",
                code="conversation_already_has_active_response",
            )
        await self._start_response(self._spec(event))

    async def _start_response(self, spec: ResponseSpec) -> None:
        run = ResponseRun(spec, self.conversation.messages(spec.instructions))
        self.response = run
        await self.send(server_event("response.created", response=run.public(self.conversation_id)))
        self.conversation.add(run.item)
        await self.send(
            server_event(
                "response.output_item.added", response_id=run.id, output_index=0, item=run.item.public()
            )
        )
        await self.send(server_event("conversation.item.added", item=run.item.public()))
        part = {"type": "audio", "transcript": ""} if spec.audio else {"type": "text", "text": ""}
        await self.send(server_event("response.content_part.added", **run.ids(), part=part))
        run.task = asyncio.create_task(self._respond(run))

    def _prepare(self, run: ResponseRun):
        """The response's prompt and per-stage params (a thread: tokenizing, audio features)."""
        omni = self.omni
        prepared = omni.prepare({"messages": run.messages, "speaker": run.spec.voice})
        thinker = omni.stages[omni.text_stage_id].default_sampling_params
        if run.spec.max_output_tokens is not None:
            thinker = thinker.replace(max_tokens=run.spec.max_output_tokens)
        prompt_len = len(prepared.text_prompt.prompt_token_ids)
        if prompt_len + thinker.max_tokens > omni.max_model_len:
            raise PromptTooLong.of(prompt_len, thinker.max_tokens, omni.max_model_len)
        prefill = omni.pd_pair.prefill_stage_id if omni.pd_pair else None
        params = [
            thinker if s.stage_id in (omni.text_stage_id, prefill) else None for s in omni.config.stages
        ]
        return prepared, params

    async def _respond(self, run: ResponseRun) -> None:
        try:
            await stream_response(
                run,
                self.omni,
                self.state,
                self.send,
                self._prepare,
                inline=_text_only(run.messages, INLINE_CHARS),
            )
            self.state.metrics.requests.labels(outcome="success").inc()
        except asyncio.CancelledError:
            run.status, run.reason = "cancelled", run.reason or "client_cancelled"
            self.state.metrics.requests.labels(outcome="aborted").inc()
        except Exception as exc:  # noqa: BLE001 - reported in response.done, as OpenAI does
            error = self.error_of(exc)
            body = getattr(error, "body", None)
            run.status = "failed"
            run.error = (
                {"type": body.error.type, "code": body.error.code or "", "message": body.error.message}
                if body is not None
                else {"type": "server_error", "code": "", "message": str(exc)}
            )
        self.state.metrics.realtime_responses.labels(status=run.status).inc()
        try:
            await finish_response(run, self.conversation_id, self.send, self.omni.pipeline.speech_text)
        finally:
            if self.response is run:
                self.response = None

    async def cancel(self, event: ResponseCancel) -> None:
        run = self.response
        if run is None or (event.response_id and event.response_id != run.id):
            raise RealtimeError(
                "there is no running response to cancel"
                if run is None
                else f"response {event.response_id!r} is not running",
                param="response_id",
                code="response_cancel_not_active",
            )
        await self.cancel_response("client_cancelled")

    async def cancel_response(self, reason: str) -> None:
        """Stop the running response now: its stages abort, and its response.done says
        cancelled (`reason`: client_cancelled, turn_detected)."""
        run = self.response
        if run is None or run.task is None:
            return
        run.reason = reason
        began = time.perf_counter()
        run.task.cancel()
        await asyncio.wait([run.task])
        log.debug(
            "realtime response %s cancelled (%s) in %.1f ms",
            run.id,
            reason,
            (time.perf_counter() - began) * 1e3,
        )

    def counts(self) -> dict[str, int]:
        return {
            "responses": int(self.response is not None),
            "items": len(self.conversation.items),
            "buffer_bytes": len(self.buffer),
        }


def _text_only(messages: list[dict[str, Any]], limit: int) -> bool:
    """Whether `messages` hold no audio and at most `limit` characters of text."""
    chars = 0
    for message in messages:
        content = message["content"]
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part["type"] != "text":
                return False
            chars += len(part["text"])
    return chars <= limit
