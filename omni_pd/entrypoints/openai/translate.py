"""OpenAI chat request -> omni-pd prompt, thinker sampling params and modalities; every problem
is an APIError naming the parameter."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...audio_io import decode_audio
from ...sampling import SamplingParams
from .protocol import APIError, ChatCompletionRequest

AUDIO_INPUT_FORMATS = ("wav", "flac", "ogg")
AUDIO_OUTPUT_FORMATS = ("pcm16", "wav")  # pcm16: 24 kHz mono int16; wav: float32, whole answer
# As vLLM (_SAMPLING_EPS): a temperature below this samples greedily. Dividing float32 logits by a
# far smaller one (1e-300 is 0 in float32) makes them inf and the sampler fail.
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**63 - 1)  # as vLLM and OpenAI: a 64-bit integer

# OpenAI (and vLLM) request fields omni-pd does not implement, each with the values that ask for
# nothing (their defaults): a request setting one to anything else is refused by name instead of
# being served as if the field were absent.
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # without tools, "auto" calls none
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    # vLLM's extra sampling fields, which vLLM clients send to omni-pd as to vLLM
    "top_k": (None, -1, 0),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "echo": (None, False),
}
UNSUPPORTED_FIELDS = tuple(_NOOP_VALUES)


@dataclass
class TranslatedRequest:
    prompt: dict[str, Any]
    thinker_params: SamplingParams
    modalities: tuple[str, ...]
    audio_format: str  # one of AUDIO_OUTPUT_FORMATS


def _bad(message: str, param: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _same(value: Any, noop: Any) -> bool:
    if isinstance(value, bool) or isinstance(noop, bool):
        return value is noop  # `logprobs: 0` is not `false`
    if isinstance(noop, (int, float)):
        return isinstance(value, (int, float)) and value == noop  # 0 and 0.0 alike
    return type(value) is type(noop) and value == noop


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    extra = request.model_extra or {}
    for name, noops in _NOOP_VALUES.items():
        value = extra.get(name)
        if not any(_same(value, noop) for noop in noops):
            allowed = " or ".join(json.dumps(v) for v in noops)
            raise _bad(
                f"omni-pd does not support `{name}` (got {json.dumps(value)[:80]}); "
                f"remove it or send {allowed}",
                name,
                "unsupported_parameter",
            )
    if request.n != 1:
        raise _bad(
            f"omni-pd does not support `n` other than 1 (got {request.n}): it returns one "
            "choice per request; send n: 1 or several requests",
            "n",
            "unsupported_parameter",
        )


def _invalid_unicode(value: Any, path: str) -> str | None:
    """Where in `value` a string holds a lone UTF-16 surrogate (JSON "\\ud800" without its
    pair), which is not text and which the tokenizer cannot take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode()
            found = _invalid_unicode(key, f"{path}.{name}" if path else name) or _invalid_unicode(
                item, f"{path}.{name}" if path else name
            )
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _invalid_unicode(item, f"{path}[{index}]")
            if found:
                return found
    return None


def _content(message_index: int, content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part_index, part in enumerate(content):
        param = f"messages[{message_index}].content[{part_index}]"
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(
                    f"a text part's `text` must be a string, got {json.dumps(text)[:80]}", f"{param}.text"
                )
            parts.append({"type": "text", "text": text})
        elif kind == "input_audio":
            spec = part.get("input_audio")
            if not isinstance(spec, dict):
                raise _bad(
                    '`input_audio` must be an object {"data": <base64 audio file>, "format": "wav"}',
                    f"{param}.input_audio",
                )
            fmt = spec.get("format", "wav")
            if fmt not in AUDIO_INPUT_FORMATS:
                raise _bad(
                    f"input audio format {fmt!r} is not supported; send one of {list(AUDIO_INPUT_FORMATS)}",
                    f"{param}.input_audio.format",
                )
            data = spec.get("data")
            if not isinstance(data, str) or not data:
                raise _bad(
                    f"`input_audio.data` must be the base64 of a {fmt} file, got {json.dumps(data)[:80]}",
                    f"{param}.input_audio.data",
                )
            try:
                audio = decode_audio(base64.b64decode(data, validate=True), fmt)
            except (binascii.Error, ValueError, RuntimeError) as exc:
                raise _bad(
                    f"input audio could not be decoded as base64 {fmt}: {exc}", f"{param}.input_audio.data"
                ) from None
            if audio.size == 0 or not np.isfinite(audio).all():
                raise _bad(
                    "the input audio holds no samples"
                    if audio.size == 0
                    else "the input audio holds NaN or infinite samples",
                    f"{param}.input_audio.data",
                )
            parts.append({"type": "audio", "audio": audio})
        else:
            raise _bad(
                f"content part type {kind!r} is not supported; use 'text' or 'input_audio'",
                f"{param}.type",
                "unsupported_content",
            )
    return parts


def _output_format(request: ChatCompletionRequest) -> tuple[tuple[str, ...], str]:
    """The request's output modalities and its audio format, refused where unsupported."""
    modalities = tuple(request.modalities or ["text"])
    if modalities not in (("text",), ("text", "audio"), ("audio", "text")):
        raise _bad(
            f"modalities {list(modalities)} are not supported; use ['text'] or ['text', 'audio']",
            "modalities",
            "unsupported_modality",
        )
    audio = request.audio
    audio_format = (audio.format if audio else None) or ("pcm16" if request.stream else "wav")
    if audio_format not in AUDIO_OUTPUT_FORMATS:
        raise _bad(
            f"audio format {audio_format!r} is not supported; use one of {list(AUDIO_OUTPUT_FORMATS)}",
            "audio.format",
            "unsupported_audio_format",
        )
    if request.stream and audio_format != "pcm16":
        # As OpenAI: a streamed answer's audio comes in pieces, which only raw PCM can be.
        raise _bad(
            f'audio format {audio_format!r} cannot be streamed; use "pcm16" with '
            "stream: true, or stream: false for a whole wav",
            "audio.format",
            "unsupported_audio_format",
        )
    return modalities, audio_format


def _sampling_changes(request: ChatCompletionRequest) -> dict[str, Any]:
    """The sampling params the request sets over the text stage's defaults, each range-checked."""
    changes: dict[str, Any] = {}
    if request.temperature is not None:
        if not 0.0 <= request.temperature <= 2.0:  # NaN too
            raise _bad(
                f"temperature {request.temperature} is out of range [0, 2]; send 0 for "
                f"greedy decoding (any temperature below {GREEDY_BELOW_TEMPERATURE:g} is "
                "greedy too)",
                "temperature",
            )
        greedy = request.temperature < GREEDY_BELOW_TEMPERATURE
        changes["temperature"] = 0.0 if greedy else request.temperature
    if request.top_p is not None:
        if not 0.0 < request.top_p <= 1.0:
            raise _bad(
                f"top_p {request.top_p} is out of range (0, 1]; send 1 for no nucleus filtering", "top_p"
            )
        changes["top_p"] = request.top_p
    name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(request, name)
    if max_tokens is not None:
        if max_tokens < 1:
            raise _bad(f"{name} must be at least 1, got {max_tokens}", name)
        changes["max_tokens"] = max_tokens
    if request.seed is not None:
        if not SEED_RANGE[0] <= request.seed <= SEED_RANGE[1]:
            raise _bad(f"seed {request.seed} is out of range: send a 64-bit integer", "seed")
        changes["seed"] = request.seed
    if request.stop is not None:
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if len(stops) > 4:
            raise _bad("at most 4 stop sequences are allowed", "stop")
        changes["stop"] = tuple(s for s in stops if s)
    return changes


def translate(
    request: ChatCompletionRequest, thinker_defaults: SamplingParams, served_model: str
) -> TranslatedRequest:
    where = _invalid_unicode(request.model_dump(exclude_unset=True), "")
    if where:
        raise _bad(
            f"{where} holds a lone UTF-16 surrogate (such as \\ud800 without its pair), "
            "which is not valid Unicode; send UTF-8 text, with any surrogates in pairs",
            where,
            "invalid_unicode",
        )
    if request.model != served_model:
        raise APIError(
            404,
            f"the model {request.model!r} does not exist; this server serves {served_model!r}",
            param="model",
            code="model_not_found",
        )
    if not request.messages:
        raise _bad("messages must hold at least one message", "messages")
    _refuse_unsupported(request)
    modalities, audio_format = _output_format(request)
    changes = _sampling_changes(request)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": _content(i, m.content)}
        for i, m in enumerate(request.messages)
    ]
    audio = request.audio
    prompt = {"messages": messages, "speaker": audio.voice if audio else None}  # None: the model's default
    return TranslatedRequest(
        prompt=prompt,
        thinker_params=thinker_defaults.replace(**changes),
        modalities=("text", "audio") if "audio" in modalities else ("text",),
        audio_format=audio_format,
    )
