"""OpenAI chat-completions request schema (the subset omni-pd serves) and its error body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# `omni-pd serve --max-request-bytes`'s default. 16 MiB holds a base64 WAV of about 6 minutes of
# 16 kHz mono 16-bit audio (4 at 24 kHz, 1 at 44.1 kHz stereo), far more as FLAC or OGG; parsing
# that much JSON takes about 0.1 s.
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
CHAT_PATH = "/v1/chat/completions"
REALTIME_PATH = "/v1/realtime"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class APIError(Exception):
    """A request error that becomes OpenAI's error JSON with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers  # e.g. Retry-After on a 503
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))


class AudioSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    voice: str = "ethan"
    format: str | None = None  # default: "pcm16" when streaming (the only streamable one), else "wav"


class ChatMessage(BaseModel):
    # Clients send fields we do not use (name, tool_calls, ...): accepted and ignored.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (vllm-omni's benchmark client asks
    # for it, and counts a chunk's tokens from it).
    continuous_usage_stats: bool = False


class ChatCompletionRequest(BaseModel):
    # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage]
    modalities: list[str] | None = None
    audio: AudioSpec | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1)
