"""Qwen2.5-Omni's token2wav: codec codes -> mel (a flow-matching DiT, integrated from noise) ->
24 kHz samples (BigVGAN), whole or windowed.

Whole: transformers' `Qwen2_5OmniToken2WavModel.forward` (one ODE over the whole utterance, then
the vocoder over all of its mel), except for where the noise comes from: transformers draws one
`torch.randn` over the utterance from the global generator; here each block of 24 mel frames has
its own draw from a generator seeded by (seed, block), so a frame's noise depends on its place
only, not on the utterance's length or on anything else the process ran.

Windowed (the model's streaming mode, as vllm-omni streams it): the mel is computed in windows of
`WINDOW` frames, each integrated alone over its frames plus `PAST` frames before and `FUTURE`
after (the DiT's block attention looks two blocks back and one ahead), and the vocoder runs per
window over the window's mel plus `2 * OVERLAP` frames of the previous one, trimming `OVERLAP`
frames' samples at each inner edge. A window's samples depend only on the codes and noise of its
span, so the audio is the same however the codes arrive (in any chunks, or all at once); it is
not the whole-utterance ODE's once an utterance is longer than one window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

from ..factory import find_voice

WINDOW = 72  # mel frames a window emits (3 DiT blocks)
PAST = 48  # mel frames of context before a window (2 blocks)
FUTURE = 24  # mel frames of context after it (1 block)
OVERLAP = 20  # mel frames the vocoder's edges need on each side


@dataclass
class Conditioning:
    cond: torch.Tensor  # [1, enc_emb_dim]: the voice's speaker embedding
    ref_mel: torch.Tensor  # [1, frames, mel_dim]: its reference mel


@dataclass
class WindowedStream:
    """One utterance's progress through the windows."""

    voice: Conditioning
    codes: list[int] = field(default_factory=list)
    windows: int = 0  # windows emitted
    mel_tail: torch.Tensor | None = None  # [1, mel_dim, <= 2 * OVERLAP]: the last window's end


class Token2Wav:
    def __init__(
        self,
        token2wav: torch.nn.Module,
        seed: int = 0,
        num_steps: int = 10,
        guidance_scale: float = 0.5,
        sway_coefficient: float = -1.0,
    ):
        self.dit = token2wav.code2wav_dit_model
        self.vocoder = token2wav.code2wav_bigvgan_model
        self.seed, self.num_steps = seed, num_steps
        self.guidance_scale, self.sway_coefficient = guidance_scale, sway_coefficient
        self.repeats, self.mel_dim, self.block = self.dit.repeats, self.dit.mel_dim, self.dit.block_size
        self.hop = 1
        for rate in self.vocoder.config.upsample_rates:
            self.hop *= int(rate)
        if WINDOW % self.block or PAST % self.block or WINDOW < 2 * OVERLAP:
            raise ValueError(f"token2wav windows must be whole DiT blocks of {self.block} frames")

    # ---- noise and mel --------------------------------------------------------------------------
    def noise(self, start: int, end: int) -> torch.Tensor:
        """[1, end - start, mel_dim]: mel frames start .. end's starting noise."""
        rows = []
        for block in range(start // self.block, (end - 1) // self.block + 1):
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + block) % (2**63))
            rows.append(torch.randn(self.block, self.mel_dim, generator=generator))
        first = (start // self.block) * self.block
        return torch.cat(rows)[start - first : end - first].unsqueeze(0)

    @torch.no_grad()
    def mel(self, codes: torch.Tensor, voice: Conditioning, x0: torch.Tensor) -> torch.Tensor:
        """[1, mel_dim, frames]: the DiT's ODE from `x0` ([1, frames, mel_dim]) for `codes`
        ([1, frames / repeats]), as transformers' `sample` integrates it."""
        frames = x0.shape[1]
        cond = voice.cond.unsqueeze(1).repeat(1, frames, 1)
        scale = self.guidance_scale

        def velocity(time_step, hidden):
            if scale < 1e-5:
                return self.dit(
                    hidden_states=hidden,
                    speaker_embedding=cond,
                    condition_vector=voice.ref_mel,
                    quantized_code=codes,
                    time_step=time_step,
                    drop_audio_conditioning=False,
                    drop_code=False,
                    apply_cfg=False,
                )
            both = self.dit(
                hidden_states=hidden,
                quantized_code=codes,
                speaker_embedding=cond,
                condition_vector=voice.ref_mel,
                time_step=time_step,
                apply_cfg=True,
            )
            guided, free = torch.chunk(both, 2, dim=0)
            return guided + (guided - free) * scale

        times = torch.linspace(0, 1, self.num_steps, dtype=cond.dtype)
        if self.sway_coefficient is not None:
            times += self.sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
        return RungeKutta4ODESolver(velocity, x0).integrate(times)[-1].permute(0, 2, 1)

    @torch.no_grad()
    def samples(self, mel: torch.Tensor) -> torch.Tensor:
        return self.vocoder(mel).reshape(-1).float()

    # ---- whole ----------------------------------------------------------------------------------
    def whole(self, codes: torch.Tensor, voice: Conditioning) -> torch.Tensor:
        frames = codes.shape[-1] * self.repeats
        return self.samples(self.mel(codes.view(1, -1), voice, self.noise(0, frames)))

    # ---- windowed -------------------------------------------------------------------------------
    def feed(self, stream: WindowedStream, codes: list[int], final: bool) -> torch.Tensor:
        """The samples of every window that the codes so far complete (all of them if `final`)."""
        stream.codes.extend(codes)
        total = len(stream.codes) * self.repeats
        pieces = []
        while stream.windows * WINDOW < total:
            start = stream.windows * WINDOW
            if not final and total < start + WINDOW + FUTURE:
                break
            pieces.append(self._window(stream, start, total))
            stream.windows += 1
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def _window(self, stream: WindowedStream, start: int, total: int) -> torch.Tensor:
        end = min(start + WINDOW, total)
        lo, hi = max(start - PAST, 0), min(end + FUTURE, total)
        codes = torch.tensor(stream.codes[lo // self.repeats : hi // self.repeats], dtype=torch.long).view(
            1, -1
        )
        mel = self.mel(codes, stream.voice, self.noise(lo, hi))[:, :, start - lo : end - lo]
        first, last = start == 0, end == total
        tail = stream.mel_tail
        stream.mel_tail = mel[:, :, -2 * OVERLAP :]
        if not first:
            assert tail is not None
            mel = torch.cat([tail, mel], dim=2)
        audio = self.samples(mel)
        cut = OVERLAP * self.hop
        return audio[(0 if first else cut) : (len(audio) if last else len(audio) - cut)]


def conditioning(speakers: dict[str, Any], voice: str | None) -> Conditioning:
    """A voice's conditioning (spk_dict.pt's `cond` and `ref_mel`), matched case-insensitively."""
    spec = find_voice(speakers, voice)
    return Conditioning(spec["cond"].float().view(1, -1), spec["ref_mel"].float())
