"""Qwen3-Omni's thinker on the generic vLLM engine: the recording model class, the prompt as vLLM
takes it, and the recorded rows turned into the same `ThinkerOutput` / `ThinkerChunk` records the
hf thinker produces, so the talker and the P/D merge cannot tell the engines apart.

Rows: the model records, for every position it computes, the layer-0 embedding and the
accept-layer hidden state. A position's rows arrive in the step that feeds its token: the
prompt's in the prefill step, a generated token's in the next decode step (the last token is
never fed, as in transformers). Each leg reports the rows it owns:
- the leg that computes the prompt (colocated, or a prefill leg) reports the prompt's rows;
- the leg that decodes (colocated, or a decode leg) reports the generated tokens' rows, from
  the end of the prompt on. A decode leg recomputes the prompt's last position to sample its
  first token; that row is its own, and the prefill leg's copy of it is the one the merge keeps,
  as it is what a colocated run computed in its one prefill pass.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_pd.engines.types import TextOutput, TokenPrompt
from omni_pd.engines.vllm.hooks import LegRole, VllmModelHooks
from omni_pd.engines.vllm.rows import RequestRows
from omni_pd.models.omni_prompt import vllm_audio_prompt

from ..records import ThinkerChunk, ThinkerOutput, ThinkerPrompt
from .thinker import CAPTURE_KEY, LAYER_KEY


# Audio inputs one prompt may hold (vLLM profiles its memory for that many at start).
MAX_AUDIOS_PER_PROMPT = 4


class Qwen3OmniThinkerHooks(VllmModelHooks):
    records_rows = True  # by RowRecordingThinker, registered for the checkpoint's architecture
    takes_multimodal_prompts = True  # audio; images and video are not built by the prompt builder

    def __init__(self, accept_hidden_layer: int, audio_token_id: int):
        self.accept_hidden_layer = accept_hidden_layer
        self.audio_token_id = audio_token_id

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "limit_mm_per_prompt": {"audio": MAX_AUDIOS_PER_PROMPT, "image": 0, "video": 0},
            # Audio comes as the prompt builder's features (precomputed items), not raw audio.
            "enable_mm_embeds": True,
            "additional_config": {CAPTURE_KEY: True, LAYER_KEY: self.accept_hidden_layer},
        }

    def check_prompt(self, stage_id: int, prompt: TokenPrompt) -> None:
        if not isinstance(prompt, ThinkerPrompt) or prompt.input_features is None:
            return
        audios = prompt.input_features.shape[0]
        if audios > MAX_AUDIOS_PER_PROMPT:
            raise ValueError(
                f"stage {stage_id}: the prompt has {audios} audio inputs; the vLLM "
                f"thinker takes at most {MAX_AUDIOS_PER_PROMPT} per prompt"
            )

    def vllm_prompt(self, prompt: TokenPrompt) -> dict[str, Any]:
        return vllm_audio_prompt(prompt, self.audio_token_id)

    def handoff_state(self, prompt_token_ids: list[int]) -> dict[str, int]:
        """The hf thinker's `rope_deltas` (its M-RoPE offset past the prompt): 0 for the prompts
        this engine takes (text and audio, whose positions M-RoPE numbers one by one); images
        and video, which would shift it, are refused by `limit_mm_per_prompt`. The e2e audio
        equality test (e2e/test_vllm_p_hf_d.py) checks it against hf colocated."""
        return {"rope_deltas": 0}

    def _prompt_rows(
        self, request_id: str, rows: RequestRows, prompt_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        span = rows.span(0, prompt_len)
        if span is None:
            raise RuntimeError(
                f"request {request_id}: the vLLM thinker recorded "
                f"{sum(p < prompt_len for p in rows.rows)} of the prompt's "
                f"{prompt_len} rows"
            )
        return span

    def _output_rows(
        self, request_id: str, rows: RequestRows, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hi <= lo:
            width = next(iter(rows.rows.values()))[0].shape[-1] if len(rows) else 0
            empty = torch.zeros((0, width))
            return empty, empty.clone()
        span = rows.span(lo, hi)
        if span is None:
            missing = [p for p in range(lo, hi) if p not in rows.rows]
            raise RuntimeError(
                f"request {request_id}: the vLLM thinker recorded no rows for "
                f"positions {missing[:8]} of {lo}..{hi - 1}"
            )
        return span

    def output(self, text: TextOutput, rows: RequestRows, role: LegRole) -> ThinkerOutput:
        prompt_len = len(text.prompt_token_ids)
        out = ThinkerOutput(
            **{
                f: getattr(text, f)
                for f in (
                    "request_id",
                    "prompt_token_ids",
                    "token_ids",
                    "text",
                    "finish_reason",
                    "kv_transfer_params",
                    "num_cached_prompt_tokens",
                    "metrics",
                )
            },
            output_start=prompt_len,
        )
        if role.computes_prompt and role.rows:
            out.prompt_embeds, out.prompt_hidden = self._prompt_rows(text.request_id, rows, prompt_len)
        if role.decodes and role.rows:
            # Every generated token but the last was fed back.
            fed = max(len(text.token_ids) - 1, 0)
            out.output_embeds, out.output_hidden = self._output_rows(
                text.request_id, rows, prompt_len, prompt_len + fed
            )
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
        start = max(rows_from, prompt_len)
        end = start
        while end in rows.rows:  # the generated tokens' rows that arrived since the last chunk
            end += 1
        embeds, _ = self._output_rows("", rows, start, end)
        chunk = ThinkerChunk(
            token_ids=list(new_token_ids),
            embeds=embeds,
            start=start,
            prompt_token_ids=list(prompt_token_ids) if first else None,
        )
        if first and role.computes_prompt:
            chunk.prompt_embeds, chunk.prompt_hidden = self._prompt_rows("", rows, prompt_len)
        return chunk, end
