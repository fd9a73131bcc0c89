"""Writing waveforms, and the 16-bit PCM that OpenAI's streamed audio uses.

Float WAVs keep the model's samples exactly: random-weight audio peaks near 1e-6, silence in 16-bit
PCM without a gain."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np
import soundfile
import torch

PCM16_SAMPLE_RATE = 24_000  # OpenAI's pcm16: 24 kHz mono little-endian int16
# The tiny random-weight code2wav's waveform peaks at 0.8e-6 to 1.0e-6 (RMS 1.5e-7) over varied
# prompts; this gain puts its peaks near half of full scale (RMS about -22 dBFS), clipping nothing.
DUMMY_WEIGHTS_PCM16_GAIN = 5e5


# What speech encoders read (Whisper's log-mel features): the rate audio inputs are decoded to.
INPUT_SAMPLE_RATE = 16_000


def decode_audio(
    data: str | bytes, fmt: str | None = None, sample_rate: int = INPUT_SAMPLE_RATE
) -> np.ndarray:
    """Base64 (or raw bytes) of a WAV/FLAC/OGG file -> mono float32 at `sample_rate`. `fmt` (the
    client's name for the format) is informational: libsndfile reads the container itself."""
    import librosa

    raw = base64.b64decode(data) if isinstance(data, str) else data
    samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    if rate != sample_rate:
        mono = librosa.resample(mono, orig_sr=rate, target_sr=sample_rate)
    return np.ascontiguousarray(mono, dtype=np.float32)


# libsndfile's SFC_SET_ADD_PEAK_CHUNK (sndfile.h): whether a float file gets a PEAK chunk.
_SFC_SET_ADD_PEAK_CHUNK = 0x1050


def open_wav(target: str | Path | BinaryIO, sample_rate: int) -> soundfile.SoundFile:
    """A float32 mono WAV open for writing, chunk by chunk or at once. Its bytes depend on the
    samples alone: libsndfile adds a PEAK chunk holding the time of writing to float files,
    so two identical answers gave files that differed in a few bytes; it is switched off here,
    before any sample is written, with libsndfile's own command."""
    if not hasattr(target, "write"):
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        target = str(target)
    wav = soundfile.SoundFile(target, "w", samplerate=sample_rate, channels=1, format="WAV", subtype="FLOAT")
    # soundfile has no wrapper for this command: its libsndfile handle (`_file`) and cffi
    # library (`_snd`) are how soundfile itself calls sf_command.
    soundfile._snd.sf_command(
        wav._file, _SFC_SET_ADD_PEAK_CHUNK, soundfile._ffi.NULL, soundfile._snd.SF_FALSE
    )
    return wav


def write_wav(target: str | Path | BinaryIO, audio: torch.Tensor, sample_rate: int) -> str | Path | BinaryIO:
    """The whole waveform as a float32 WAV (`open_wav`: the same bytes for the same samples)."""
    with open_wav(target, sample_rate) as wav:
        wav.write(audio.to(torch.float32).numpy())
    return Path(target) if isinstance(target, str) else target


def pcm16_gain(load_format: str, dummy_gain: float | None = None) -> float:
    """The gain before 16-bit conversion for audio from a code2wav stage loaded with `load_format`:
    dummy (random) weights are near silent unless the model says otherwise (`dummy_gain`), real
    weights produce full-scale audio."""
    if load_format != "dummy":
        return 1.0
    return DUMMY_WEIGHTS_PCM16_GAIN if dummy_gain is None else dummy_gain


def stage_config_pcm16_gain(stages: Iterable[Any], dummy_gain: float | None = None) -> float:
    """`pcm16_gain` of the stage that outputs the audio (`final_output_type: audio`), 1.0 with none."""
    audio = [s for s in stages if s.final_output and s.final_output_type == "audio"]
    return pcm16_gain(audio[-1].engine_args.load_format, dummy_gain) if audio else 1.0


def to_pcm16(audio: torch.Tensor, gain: float = 1.0) -> torch.Tensor:
    """int16 = round(clip(x * gain, -1, 1) * 32767), elementwise: chunks converted one by one
    concatenate to the whole waveform converted at once."""
    scaled = torch.clamp(audio.to(torch.float32) * gain, -1.0, 1.0) * 32767.0
    return torch.round(scaled).to(torch.int16)


def pcm16_bytes(audio: torch.Tensor, sample_rate: int, gain: float = 1.0) -> bytes:
    """`to_pcm16` as little-endian bytes; refuses audio not at `PCM16_SAMPLE_RATE`."""
    if sample_rate != PCM16_SAMPLE_RATE:
        raise RuntimeError(
            f"pcm16 is {PCM16_SAMPLE_RATE} Hz mono, but this model's audio is at "
            f"{sample_rate} Hz (no resampler here); request audio.format 'wav' with stream: false"
        )
    return to_pcm16(audio, gain).numpy().astype("<i2", copy=False).tobytes()
