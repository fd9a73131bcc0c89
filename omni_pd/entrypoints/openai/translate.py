"""OpenAI chat request -> omni-pd prompt, thinker sampling params and modalities; every problem
is an APIError naming the parameter."""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from ...models.qwen3_omni.prompt import decode_audio
from ...sampling import SamplingParams
from .protocol import APIError, ChatCompletionRequest

AUDIO_INPUT_FORMATS = ("wav", "flac", "ogg")
AUDIO_OUTPUT_FORMATS = ("pcm16", "wav")  # pcm16: 24 kHz mono int16; wav: float32, whole answer


@dataclass
class TranslatedRequest:
    prompt: dict[str, Any]
    thinker_params: SamplingParams
    modalities: tuple[str, ...]
    audio_format: str  # one of AUDIO_OUTPUT_FORMATS


def _bad(message: str, param: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _content(message_index: int, content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part_index, part in enumerate(content):
        param = f"messages[{message_index}].content[{part_index}]"
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_audio":
            spec = part.get("input_audio") or {}
            fmt = spec.get("format", "wav")
            if fmt not in AUDIO_INPUT_FORMATS:
                raise _bad(f"input audio format {fmt!r} is not supported; send one of "
                           f"{list(AUDIO_INPUT_FORMATS)}", f"{param}.input_audio.format")
            try:
                audio = decode_audio(base64.b64decode(spec.get("data", ""), validate=True), fmt)
            except (binascii.Error, ValueError, RuntimeError) as exc:
                raise _bad(f"input audio could not be decoded as base64 {fmt}: {exc}",
                           f"{param}.input_audio.data") from None
            parts.append({"type": "audio", "audio": audio})
        else:
            raise _bad(f"content part type {kind!r} is not supported; use 'text' or 'input_audio'",
                       f"{param}.type", "unsupported_content")
    return parts


def translate(request: ChatCompletionRequest, thinker_defaults: SamplingParams,
              served_model: str) -> TranslatedRequest:
    if request.model != served_model:
        raise APIError(404, f"the model {request.model!r} does not exist; this server serves "
                       f"{served_model!r}", param="model", code="model_not_found")
    if not request.messages:
        raise _bad("messages must hold at least one message", "messages")
    if request.n != 1:
        raise _bad("only n=1 is supported", "n")
    modalities = tuple(request.modalities or ["text"])
    if modalities not in (("text",), ("text", "audio"), ("audio", "text")):
        raise _bad(f"modalities {list(modalities)} are not supported; use ['text'] or "
                   "['text', 'audio']", "modalities", "unsupported_modality")
    audio = request.audio
    audio_format = (audio.format if audio else None) or ("pcm16" if request.stream else "wav")
    if audio_format not in AUDIO_OUTPUT_FORMATS:
        raise _bad(f"audio format {audio_format!r} is not supported; use one of "
                   f"{list(AUDIO_OUTPUT_FORMATS)}", "audio.format", "unsupported_audio_format")
    if request.stream and audio_format != "pcm16":
        # As OpenAI: a streamed answer's audio comes in pieces, which only raw PCM can be.
        raise _bad(f"audio format {audio_format!r} cannot be streamed; use \"pcm16\" with "
                   "stream: true, or stream: false for a whole wav", "audio.format",
                   "unsupported_audio_format")
    changes: dict[str, Any] = {}
    if request.temperature is not None:
        if not 0.0 <= request.temperature <= 2.0:
            raise _bad(f"temperature {request.temperature} is out of range [0, 2]", "temperature")
        changes["temperature"] = request.temperature
    if request.top_p is not None:
        if not 0.0 < request.top_p <= 1.0:
            raise _bad(f"top_p {request.top_p} is out of range (0, 1]", "top_p")
        changes["top_p"] = request.top_p
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            name = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
            raise _bad(f"{name} must be at least 1, got {max_tokens}", name)
        changes["max_tokens"] = max_tokens
    if request.seed is not None:
        changes["seed"] = request.seed
    if request.stop is not None:
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if len(stops) > 4:
            raise _bad("at most 4 stop sequences are allowed", "stop")
        changes["stop"] = tuple(s for s in stops if s)
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": _content(i, m.content)} for i, m in enumerate(request.messages)]
    prompt = {"messages": messages, "speaker": audio.voice if audio else "ethan"}
    return TranslatedRequest(prompt=prompt, thinker_params=thinker_defaults.replace(**changes),
                             modalities=("text", "audio") if "audio" in modalities else ("text",),
                             audio_format=audio_format)
