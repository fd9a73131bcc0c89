"""code2wav: codec codes in, a 24 kHz float32 waveform out."""
from __future__ import annotations

import time

import torch

from ..types import AudioOutput, Code2WavPrompt

SAMPLE_RATE = 24_000
CHUNK_SIZE = 300  # codec frames per decode chunk, as transformers' generate uses
LEFT_CONTEXT = 25


class Code2WavRunner:
    def __init__(self, code2wav: torch.nn.Module):
        self.code2wav = code2wav

    @torch.no_grad()
    def generate(self, prompt: Code2WavPrompt) -> AudioOutput:
        began = time.perf_counter()
        if prompt.codes.shape[-1] == 0:
            audio = torch.zeros(0, dtype=torch.float32)
        else:
            wav = self.code2wav.chunked_decode(prompt.codes.unsqueeze(0), chunk_size=CHUNK_SIZE,
                                               left_context_size=LEFT_CONTEXT)
            audio = wav.reshape(-1).float().contiguous()
        return AudioOutput(request_id=prompt.request_id, audio=audio, sample_rate=SAMPLE_RATE,
                           metrics={"code2wav_ms": (time.perf_counter() - began) * 1e3})
