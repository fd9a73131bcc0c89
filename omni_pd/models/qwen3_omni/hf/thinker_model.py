"""The thinker's forward passes, split at the prefill/decode boundary.

`prefill` runs the prompt once and returns its KV cache with the prompt's layer-0 and accept-layer
hidden states; `decode` continues from a cache, whether that cache was built here (colocated) or
rebuilt from blocks another process sent (P/D). Both legs share one code path, which is what
makes P/D byte-identical to a colocated run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from omni_pd.sampling import SamplingParams
from omni_pd.engines.core.text import TextStops
from omni_pd.engines.sampler import sample_next_token
from omni_pd.models.omni_prompt import AudioClip, audio_clips, encode_clip
from omni_pd.models.qwen3_omni.prompt import audio_token_count
from omni_pd.models.qwen3_omni.records import ThinkerPrompt


@dataclass
class PrefillResult:
    cache: DynamicCache
    logits: torch.Tensor  # [vocab]: the last prompt position's
    first_token: int
    rope_deltas: int
    prompt_embeds: torch.Tensor  # [prompt_len, hidden]
    prompt_hidden: torch.Tensor
    prefill_ms: float


@dataclass
class ThinkerDecode:
    token_ids: list[int]
    finish_reason: str
    text: str
    output_embeds: torch.Tensor  # [len(token_ids) - 1 or fewer, hidden]
    output_hidden: torch.Tensor
    decode_ms: float


class ThinkerModel:
    def __init__(
        self, thinker: torch.nn.Module, tokenizer, accept_hidden_layer: int, eos_token_ids: set[int]
    ):
        self.thinker = thinker
        self.tokenizer = tokenizer
        self.accept_hidden_layer = accept_hidden_layer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stops = TextStops(tokenizer, self.eos_token_ids)
        self.text_config = thinker.config.text_config

    def audio_clips(self, prompt: ThinkerPrompt) -> list[AudioClip]:
        config = self.thinker.config
        n_window = config.audio_config.n_window
        return audio_clips(prompt, config.audio_token_id, lambda frames: audio_token_count(frames, n_window))

    @torch.no_grad()
    def layer0_rows(self, prompt: ThinkerPrompt, clips: list[AudioClip], start: int) -> torch.Tensor:
        """Layer 0 of prompt positions `start`.. : the embedding table's rows, with each audio
        input's encoder output at its placeholders (as transformers' forward merges them). Each
        audio input is encoded alone, and only if it reaches past `start`, so its rows do not
        depend on the other inputs of the prompt nor on how much of it was cached."""
        ids = torch.tensor(prompt.prompt_token_ids[start:], dtype=torch.long)
        rows = self.thinker.get_input_embeddings()(ids)
        for clip in clips:
            if clip.end <= start:
                continue
            encoded = encode_clip(self.thinker, prompt, clip, rows.dtype)
            skip = max(0, start - clip.start)
            rows[clip.start + skip - start : clip.end - start] = encoded[skip:]
        return rows

    def _positions(self, start: int, length: int, rope_deltas: int) -> torch.Tensor:
        # [4, 1, length]: the text row drives the causal mask, the three mrope rows the rotary.
        text = torch.arange(start, start + length).view(1, 1, -1)
        return torch.cat([text, (text + rope_deltas).expand(3, 1, -1)], dim=0)

    @torch.no_grad()
    def prefill(self, prompt: ThinkerPrompt, params: SamplingParams) -> PrefillResult:
        began = time.perf_counter()
        input_ids = torch.tensor([prompt.prompt_token_ids], dtype=torch.long)
        attention_mask = torch.ones_like(input_ids)
        audio_lengths = None
        if prompt.feature_attention_mask is not None:
            audio_lengths = prompt.feature_attention_mask.sum(-1)
        mrope, deltas = self.thinker.get_rope_index(
            input_ids, None, None, attention_mask, False, audio_lengths, None
        )
        rope_deltas = int(deltas.reshape(-1)[0].item())
        text = torch.arange(input_ids.shape[1]).view(1, 1, -1)
        position_ids = torch.cat([text, mrope.to(torch.long)], dim=0)
        cache = DynamicCache(config=self.text_config)
        out = self.thinker(
            input_ids=input_ids,
            input_features=prompt.input_features,
            feature_attention_mask=prompt.feature_attention_mask,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        first = sample_next_token(out.logits[0, -1], params, step=0, seen_token_ids=prompt.prompt_token_ids)
        return PrefillResult(
            cache=cache,
            logits=out.logits[0, -1],
            first_token=first,
            rope_deltas=rope_deltas,
            prompt_embeds=out.hidden_states[0][0].clone(),
            prompt_hidden=out.hidden_states[self.accept_hidden_layer][0].clone(),
            prefill_ms=(time.perf_counter() - began) * 1e3,
        )

    def finish_reason(self, tokens: list[int], params: SamplingParams) -> str | None:
        return self.stops.finish_reason(tokens, params)

    def detokenize(self, tokens: list[int], params: SamplingParams) -> str:
        return self.stops.detokenize(tokens, params)

    @torch.no_grad()
    def decode(
        self,
        prompt_token_ids: list[int],
        cache: DynamicCache,
        rope_deltas: int,
        first_token: int,
        params: SamplingParams,
        on_token=None,
    ) -> ThinkerDecode:
        """Generate from a cache holding the whole prompt; `first_token` was sampled at step 0."""
        began = time.perf_counter()
        prompt_len = len(prompt_token_ids)
        if cache.get_seq_length() != prompt_len:
            raise ValueError(f"cache holds {cache.get_seq_length()} positions, prompt has {prompt_len}")
        tokens = [first_token]
        if on_token is not None:
            on_token(first_token)
        embeds: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        reason = self.finish_reason(tokens, params)
        while reason is None:
            position = prompt_len + len(tokens) - 1
            out = self.thinker(
                input_ids=torch.tensor([[tokens[-1]]], dtype=torch.long),
                attention_mask=torch.ones((1, position + 1), dtype=torch.long),
                position_ids=self._positions(position, 1, rope_deltas),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
            )
            embeds.append(out.hidden_states[0][0, -1])
            hidden.append(out.hidden_states[self.accept_hidden_layer][0, -1])
            token = sample_next_token(
                out.logits[0, -1], params, step=len(tokens), seen_token_ids=prompt_token_ids + tokens
            )
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            reason = self.finish_reason(tokens, params)
        width = self.text_config.hidden_size
        return ThinkerDecode(
            token_ids=tokens,
            finish_reason=reason,
            text=self.detokenize(tokens, params),
            output_embeds=torch.stack(embeds) if embeds else torch.zeros((0, width)),
            output_hidden=torch.stack(hidden) if hidden else torch.zeros((0, width)),
            decode_ms=(time.perf_counter() - began) * 1e3,
        )
