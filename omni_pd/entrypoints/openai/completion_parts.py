"""Pieces of a chat completion that the whole and the streamed answers share: usage, audio as
base64 (WAV or pcm16), the audio ids' expiry."""

from __future__ import annotations

import base64
import io
from typing import Any

import soundfile

from ...audio_io import pcm16_bytes, to_pcm16, write_wav

AUDIO_EXPIRES_S = 3600  # `expires_at`: OpenAI's audio ids expire; omni-pd keeps no audio at all


def wav_base64(audio, sample_rate: int) -> str:
    buffer = io.BytesIO()
    write_wav(buffer, audio, sample_rate)  # the same bytes for the same samples
    return base64.b64encode(buffer.getvalue()).decode()


def pcm16_base64(audio, sample_rate: int, gain: float) -> str:
    return base64.b64encode(pcm16_bytes(audio, sample_rate, gain)).decode()


def pcm16_wav_base64(audio, sample_rate: int, gain: float) -> str:
    """A 16-bit PCM WAV of `to_pcm16`'s samples: what vllm-omni streams per audio chunk (its
    clients read it with Python's `wave`, which takes integer PCM only)."""
    buffer = io.BytesIO()
    soundfile.write(buffer, to_pcm16(audio, gain).numpy(), sample_rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


def usage(output) -> dict[str, Any]:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens`: the prompt tokens whose KV
    came from the prefix cache."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(output.metrics.get("prefix_cached_tokens", 0))},
    }
