"""Realtime audio in: base64 pcm16 at 24 kHz, decoded, and resampled to what its readers take
(the thinker's audio encoder: 16 kHz; the VAD: 16 kHz)."""

from __future__ import annotations

import base64
import binascii

import numpy as np

from .events import PCM_RATE, RealtimeError

MODEL_RATE = 16_000  # Qwen3-Omni's audio encoder (Whisper features) and webrtcvad's 16 kHz mode


def decode_pcm16(data: str, param: str = "audio") -> bytes:
    """The little-endian int16 bytes of a base64 pcm16 chunk, or RealtimeError naming `param`."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(
            f"`{param}` is not base64: send base64 of 16-bit little-endian PCM, mono, {PCM_RATE} Hz",
            param=param,
        ) from None
    if len(raw) % 2:
        raise RealtimeError(f"`{param}` holds {len(raw)} bytes, not whole 16-bit samples", param=param)
    return raw


def pcm16_to_model_rate(pcm: bytes) -> np.ndarray:
    """pcm16 at 24 kHz -> float32 at 16 kHz, as the prompt's audio parts take it (librosa's
    soxr resampler: the same samples in, the same samples out, so a clip resent in a later
    turn has the same features and its cached blocks are reused)."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    import librosa  # on first use: the server starts without loading it (it pulls in numba)

    return librosa.resample(samples, orig_sr=PCM_RATE, target_sr=MODEL_RATE).astype(np.float32)


def duration_ms(pcm: bytes) -> int:
    return len(pcm) // 2 * 1000 // PCM_RATE
