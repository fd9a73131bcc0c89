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


class Code2WavModel:
    def __init__(self, code2wav: torch.nn.Module, kernels: str = "native"):
        self.exact = ExactCode2Wav(code2wav, kernels)
        self.geometry = self.exact.geometry

    @torch.no_grad()
    def generate(self, prompt: Code2WavPrompt) -> AudioOutput:
        began = time.perf_counter()
        audio = self.exact.decode(prompt.codes).float().contiguous()
        return AudioOutput(
            request_id=prompt.request_id,
            audio=audio,
            sample_rate=SAMPLE_RATE,
            metrics={"code2wav_ms": (time.perf_counter() - began) * 1e3},
        )

    def decode_chunk(
        self, stream: Code2WavStream, codes: torch.Tensor, left_context: int | None = None
    ) -> torch.Tensor:
        """The samples the next frames add to a streamed utterance (see ExactCode2Wav)."""
        return self.exact.decode_chunk(stream, codes, left_context).float().contiguous()


class Code2WavRunner:
    """code2wav as the generic chunked engine runs it (engines/core/runner.py `ChunkRunner`)."""

    name = "code2wav"
    sample_rate = SAMPLE_RATE

    def __init__(self, code2wav: torch.nn.Module, num_quantizers: int, kernels: str = "native"):
        self.runner = Code2WavModel(code2wav, kernels)
        self.num_quantizers = num_quantizers

    def read_prompt(self, request_id: str, prompt: Code2WavPrompt) -> tuple[torch.Tensor, bool]:
        return self.check_units(request_id, prompt.codes), prompt.final

    def check_units(self, request_id: str, units) -> torch.Tensor:
        if not isinstance(units, torch.Tensor) or units.dim() != 2 or units.shape[0] != self.num_quantizers:
            shape = tuple(units.shape) if isinstance(units, torch.Tensor) else type(units).__name__
            raise ValueError(
                f"request {request_id}: codes must be a [{self.num_quantizers}, frames] tensor, got {shape}"
            )
        return units.to(torch.long)

    def new_stream(self, prompt: Code2WavPrompt | None = None) -> Code2WavStream:
        return Code2WavStream()

    def decode_chunk(
        self, state: Code2WavStream, units: torch.Tensor, left_context: int | None
    ) -> torch.Tensor:
        return self.runner.decode_chunk(state, units, left_context)

    def decode_whole(
        self, request_id: str, units: torch.Tensor, state: Code2WavStream | None = None
    ) -> torch.Tensor:
        return self.runner.generate(Code2WavPrompt(request_id, units)).audio

    def exact_left_context(self) -> int:
        return self.runner.geometry.decoder_frames

    def describe(self) -> dict:
        return {"code2wav_kernels": self.runner.exact.kernels}
