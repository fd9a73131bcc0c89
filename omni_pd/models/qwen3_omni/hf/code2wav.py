"""code2wav: codec codes in, a 24 kHz float32 waveform out, whole or in chunks.

Both ways go through `ExactCode2Wav`, whose samples do not depend on how many frames one call
decodes: chunks add up to the whole-utterance waveform bit for bit, whether every layer's state is
carried from chunk to chunk (the default) or the decoder re-runs at least its receptive field of
left context.
"""
from __future__ import annotations

import time

import torch

from omni_pd.engines.types import AudioOutput

from omni_pd.models.qwen3_omni.records import Code2WavPrompt
from .code2wav_exact import Code2WavStream, ExactCode2Wav

SAMPLE_RATE = 24_000


class Code2WavRunner:
    def __init__(self, code2wav: torch.nn.Module, kernels: str = "native"):
        self.exact = ExactCode2Wav(code2wav, kernels)
        self.geometry = self.exact.geometry

    @torch.no_grad()
    def generate(self, prompt: Code2WavPrompt) -> AudioOutput:
        began = time.perf_counter()
        audio = self.exact.decode(prompt.codes).float().contiguous()
        return AudioOutput(request_id=prompt.request_id, audio=audio, sample_rate=SAMPLE_RATE,
                           metrics={"code2wav_ms": (time.perf_counter() - began) * 1e3})

    def decode_chunk(self, stream: Code2WavStream, codes: torch.Tensor,
                     left_context: int | None = None) -> torch.Tensor:
        """The samples the next frames add to a streamed utterance (see ExactCode2Wav)."""
        return self.exact.decode_chunk(stream, codes, left_context).float().contiguous()
