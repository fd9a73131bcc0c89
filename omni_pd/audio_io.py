"""Writing waveforms. Float WAVs: random-weight audio peaks near 1e-6, silence in 16-bit PCM."""
from __future__ import annotations

from pathlib import Path

import soundfile
import torch


def write_wav(path: str | Path, audio: torch.Tensor, sample_rate: int) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(out), audio.to(torch.float32).numpy(), sample_rate, subtype="FLOAT")
    return out
