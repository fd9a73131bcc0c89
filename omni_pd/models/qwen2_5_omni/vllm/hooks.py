"""Qwen2.5-Omni's thinker on the generic vLLM engine: the recorded rows turned into the same
`ThinkerOutput` / `ThinkerChunk` records the hf thinker produces (one talker row per position:
the last hidden state plus the token's embedding), so the talker and the P/D merge cannot tell
the engines apart. Prompts are text, or text with audio (the prompt builder's features, handed
to vLLM as precomputed items); images and video are refused by name. At an audio placeholder the
talker row is the hidden state alone (transformers' generate zeroes the embedding there).

Each leg reports the rows it owns, as Qwen3-Omni's hooks do: the leg that computes the prompt
its rows, the leg that decodes the generated tokens' rows from the end of the prompt on.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_pd.engines.types import TextOutput, TokenPrompt
from omni_pd.engines.vllm.hooks import LegRole, VllmModelHooks
from omni_pd.engines.vllm.rows import RequestRows
from omni_pd.models.omni_prompt import vllm_audio_prompt

from ..records import ThinkerChunk, ThinkerOutput, ThinkerPrompt
from .thinker import CAPTURE_KEY


# Audio inputs one prompt may hold (vLLM profiles its memory for that many at start).
MAX_AUDIOS_PER_PROMPT = 4


class Qwen2_5OmniThinkerHooks(VllmModelHooks):
    records_rows = True  # by RowRecordingThinker, registered for the checkpoint's architecture
    takes_multimodal_prompts = True  # audio; images and video are not built by the prompt builder

    def __init__(self, audio_token_id: int):
        self.audio_token_id = audio_token_id

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "limit_mm_per_prompt": {"audio": MAX_AUDIOS_PER_PROMPT, "image": 0, "video": 0},
            "enable_mm_embeds": True,  # audio comes as the prompt builder's features
            "additional_config": {CAPTURE_KEY: True},
        }

    def check_prompt(self, stage_id: int, prompt: TokenPrompt) -> None:
        if not isinstance(prompt, ThinkerPrompt) or prompt.input_features is None:
            return
        if prompt.input_features.shape[0] > MAX_AUDIOS_PER_PROMPT:
            raise ValueError(
                f"stage {stage_id}: the prompt has {prompt.input_features.shape[0]} audio inputs; the vLLM "
                f"thinker takes at most {MAX_AUDIOS_PER_PROMPT} per prompt"
            )

    def vllm_prompt(self, prompt: TokenPrompt) -> dict[str, Any]:
        return vllm_audio_prompt(prompt, self.audio_token_id)

    def _rows(
        self, request_id: str, rows: RequestRows, lo: int, hi: int, ids: list[int] | None = None
    ) -> torch.Tensor:
        """Positions lo .. hi's talker rows; `ids` (the prompt's, from lo): zero the embedding at
        its audio placeholders."""
        if hi <= lo:
            width = next(iter(rows.rows.values()))[0].shape[-1] if len(rows) else 0
            return torch.zeros((0, width))
        span = rows.span(lo, hi)
        if span is None:
            missing = [p for p in range(lo, hi) if p not in rows.rows]
            raise RuntimeError(
                f"request {request_id}: the vLLM thinker recorded no rows for positions {missing[:8]} of {lo}..{hi - 1}"
            )
        embeds, hidden = span
        if ids is not None:
            audio = torch.tensor(ids[: hi - lo]) == self.audio_token_id
            if bool(audio.any()):
                embeds = embeds.masked_fill(audio.unsqueeze(1), 0.0)
        return hidden + embeds  # the sum transformers' generate feeds its talker

    def output(self, text: TextOutput, rows: RequestRows, role: LegRole) -> ThinkerOutput:
        prompt_len = len(text.prompt_token_ids)
        fields = (
            "request_id",
            "prompt_token_ids",
            "token_ids",
            "text",
            "finish_reason",
            "kv_transfer_params",
            "num_cached_prompt_tokens",
            "metrics",
        )
        out = ThinkerOutput(**{f: getattr(text, f) for f in fields}, output_start=prompt_len)
        if role.computes_prompt and role.rows:
            out.prompt_rows = self._rows(text.request_id, rows, 0, prompt_len, list(text.prompt_token_ids))
        if role.decodes and role.rows:
            fed = max(len(text.token_ids) - 1, 0)  # every generated token but the last was fed back
            out.output_rows = self._rows(text.request_id, rows, prompt_len, prompt_len + fed)
        return out

    def chunk(
        self,
        prompt_token_ids: list[int],
        new_token_ids: list[int],
        rows: RequestRows,
        rows_from: int,
        role: LegRole,
        first: bool,
    ) -> tuple[ThinkerChunk, int]:
        prompt_len = len(prompt_token_ids)
        start = end = max(rows_from, prompt_len)
        while end in rows.rows:  # the generated tokens' rows that arrived since the last chunk
            end += 1
        chunk = ThinkerChunk(
            token_ids=list(new_token_ids),
            rows=self._rows("", rows, start, end),
            start=start,
            prompt_token_ids=list(prompt_token_ids) if first else None,
        )
        if first and role.computes_prompt:
            chunk.prompt_rows = self._rows("", rows, 0, prompt_len, list(prompt_token_ids))
        return chunk, end
