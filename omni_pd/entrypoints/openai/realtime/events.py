"""The Realtime API's client events as this server reads them, and its server events.

Client events are dispatched on their `type` and validated by one pydantic model each, so a
bad event gets one `error` event naming the field (`error.param`) and what to send instead. GA
names are the protocol (`output_modalities`, `audio.input.turn_detection`, ...); the beta
session names (`modalities`, `voice`, `turn_detection`, `input_audio_format: pcm16`, ...) are
read too, since they map one to one. Server events always use the GA names.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PCM_RATE = 24_000  # the only audio/pcm rate the protocol has, in and out


class RealtimeError(Exception):
    """A client event the session refuses: becomes one `error` event."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_value",
        type: str = "invalid_request_error",
        event_id: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type
        self.event_id = event_id  # the client event it answers, where that event had one


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AudioFormat(_Strict):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = PCM_RATE


class ServerVad(_Strict):
    type: Literal["server_vad"]
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=5_000)
    silence_duration_ms: int = Field(500, ge=30, le=10_000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: None = None  # not implemented: only its default (off) is taken


class AudioInput(_Strict):
    format: AudioFormat | None = None
    turn_detection: ServerVad | None = None
    transcription: None = None  # no input transcription model here
    noise_reduction: None = None


class AudioOutput(_Strict):
    format: AudioFormat | None = None
    voice: str | None = None
    speed: Literal[1.0] | None = None


class AudioConfig(_Strict):
    input: AudioInput | None = None
    output: AudioOutput | None = None


Modality = Literal["text", "audio"]


class SessionConfig(_Strict):
    type: Literal["realtime"] | None = None
    model: str | None = None
    output_modalities: list[Modality] | None = Field(None, min_length=1, max_length=1)
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    audio: AudioConfig | None = None
    tools: list[None] | None = Field(None, max_length=0)  # no tools here: only [] is taken
    tool_choice: Literal["auto", "none"] | None = None
    # Beta names of the same settings.
    modalities: list[Modality] | None = Field(None, min_length=1, max_length=2)
    voice: str | None = None
    input_audio_format: Literal["pcm16"] | None = None
    output_audio_format: Literal["pcm16"] | None = None
    turn_detection: ServerVad | None = None


class ResponseConfig(_Strict):
    output_modalities: list[Modality] | None = Field(None, min_length=1, max_length=1)
    modalities: list[Modality] | None = Field(None, min_length=1, max_length=2)  # beta
    instructions: str | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    audio: AudioConfig | None = None
    voice: str | None = None  # beta
    conversation: Literal["auto"] | None = None  # out-of-band responses are not implemented
    metadata: dict[str, str] | None = None


class ContentPart(_Strict):
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text", "audio"]
    text: str | None = None
    audio: str | None = None  # base64 pcm16, 24 kHz mono
    transcript: str | None = None


class ItemIn(_Strict):
    id: str | None = Field(None, max_length=64)
    type: Literal["message"] = "message"
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart] = Field(min_length=1)


class _Event(_Strict):
    event_id: str | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionConfig


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: ItemIn
    previous_item_id: str | None = None


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class BufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class BufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseConfig | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


CLIENT_EVENTS: dict[str, type[_Event]] = {
    model.model_fields["type"].annotation.__args__[0]: model
    for model in (
        SessionUpdate,
        ItemCreate,
        ItemTruncate,
        ItemDelete,
        BufferAppend,
        BufferCommit,
        BufferClear,
        ResponseCreate,
        ResponseCancel,
    )
}


def parse_client_event(text: str | bytes) -> _Event:
    """One client message -> its event model, or RealtimeError naming what is wrong."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RealtimeError(f"the message is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise RealtimeError(
            "a client event must be a JSON object with a `type`", param="type", code="invalid_event"
        )
    kind, event_id = raw.get("type"), raw.get("event_id")
    event_id = event_id if isinstance(event_id, str) else None
    model = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise RealtimeError(
            f"unknown event type {json.dumps(kind)[:80]}; this server takes "
            f"{', '.join(sorted(CLIENT_EVENTS))}",
            param="type",
            code="invalid_event",
            event_id=event_id,
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-"))
        message = f"{first['msg']} (got {json.dumps(first.get('input'), default=str)[:80]})"
        if first["type"] == "missing":
            message = "this field is required"
        elif first["type"] == "extra_forbidden":
            message = "this server does not take this field; remove it"
        raise RealtimeError(f"{kind}: `{param}`: {message}", param=param, event_id=event_id) from None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(error: RealtimeError) -> dict[str, Any]:
    return server_event(
        "error",
        error={
            "type": error.type,
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "event_id": error.event_id,
        },
    )


# Server events the beta protocol names otherwise (its clients send `OpenAI-Beta: realtime=v1`);
# None: the beta protocol has no such event.
_BETA_NAMES: dict[str, str | None] = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
    "conversation.item.done": None,
}


def beta_event(event: dict[str, Any]) -> dict[str, Any] | None:
    """A GA server event as the beta protocol names it (None: not sent to beta clients)."""
    if event["type"] not in _BETA_NAMES:
        return event
    name = _BETA_NAMES[event["type"]]
    return None if name is None else {**event, "type": name}
