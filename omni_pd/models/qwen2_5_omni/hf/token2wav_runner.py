"""token2wav as the generic chunked engine runs it (engines/core/runner.py `ChunkRunner`).

Codes in, 24 kHz float32 samples out. A whole utterance is transformers' whole-utterance
token2wav; a streamed one is windowed (token2wav.py): the same samples however the codes arrive,
the last window's held back until the codes end (`flush`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..records import Token2WavPrompt
from .token2wav import Token2Wav, WindowedStream, conditioning

SAMPLE_RATE = 24_000


class Token2WavRunner:
    name = "code2wav"  # vllm-omni's name for the stage
    sample_rate = SAMPLE_RATE

    def __init__(self, token2wav: Token2Wav, speakers: dict[str, Any], default_voice: str):
        self.token2wav = token2wav
        self.speakers = speakers
        self.default_voice = default_voice
        self.vocab = token2wav.dit.config.num_embeds + 1  # the DiT's codec embedding rows

    def read_prompt(self, request_id: str, prompt: Token2WavPrompt) -> tuple[torch.Tensor, bool]:
        return self.check_units(request_id, prompt.codes), prompt.final

    def check_units(self, request_id: str, units: Any) -> torch.Tensor:
        if (
            not isinstance(units, torch.Tensor)
            or units.dim() not in (1, 2)
            or (units.dim() == 2 and units.shape[0] != 1)
        ):
            shape = tuple(units.shape) if isinstance(units, torch.Tensor) else type(units).__name__
            raise ValueError(
                f"request {request_id}: codes must be a [frames] or [1, frames] tensor, got {shape}"
            )
        units = units.to(torch.long).view(1, -1)
        if units.numel() and (int(units.min()) < 0 or int(units.max()) >= self.vocab):
            raise ValueError(
                f"request {request_id}: a code is outside token2wav's codec vocabulary of {self.vocab} ids"
            )
        return units

    def new_stream(self, prompt: Token2WavPrompt | None) -> WindowedStream:
        voice = prompt.speaker if prompt is not None else self.default_voice
        return WindowedStream(conditioning(self.speakers, voice or self.default_voice))

    def decode_chunk(
        self, state: WindowedStream, units: torch.Tensor, left_context: int | None
    ) -> torch.Tensor:
        return self.token2wav.feed(state, units.view(-1).tolist(), final=False)

    def flush(self, state: WindowedStream) -> torch.Tensor:
        return self.token2wav.feed(state, [], final=True)

    def decode_whole(self, request_id: str, units: torch.Tensor, state: WindowedStream) -> torch.Tensor:
        if not units.numel():
            return torch.zeros(0)
        return self.token2wav.whole(units.view(-1), state.voice)

    def exact_left_context(self) -> int:
        return 0  # windows carry their own context; re-running earlier codes changes nothing

    def describe(self) -> dict:
        return {"token2wav_steps": self.token2wav.num_steps, "streaming": "windowed"}
