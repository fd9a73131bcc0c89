"""The thinker's batched passes: prompts admitted together, and one decode step for every running
request.

They compute what transformers' thinker text model computes (same modules and weights: RMSNorm,
q/k norm, the interleaved multimodal rotary, MoE), but batch-invariantly: every linear layer and
the MoE go through `batch_invariant` (fixed row tiles), and attention is the engine's
(`engines/core/attention.py`): each layer hands q, k, v to the step's attention call, which
attends per sequence over exactly that sequence's positions, so a request's logits are
bit-identical whether it runs alone or with 63 others. Prompts with images or video would run
alone through transformers' own forward (their 3D rotary); the engine copies their KV into the
request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

from omni_pd.engines.core.attention import StepAttention
from omni_pd.engines.core.runner import Prefilled
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.attention_native import check_kernels


@dataclass
class DecodeRow:
    """One request's place in a decode step."""

    token: int  # the token fed in (the latest sampled one)
    position: int  # its position in the sequence (= positions already cached)
    rope_deltas: int


@dataclass
class DecodeStepResult:
    logits: torch.Tensor  # [B, vocab]
    embeds: torch.Tensor  # [B, hidden]: layer 0 (the token's embedding) of each fed-in token
    hidden: torch.Tensor  # [B, hidden]: the talker's accept layer


class ThinkerForward:
    def __init__(self, thinker: torch.nn.Module, accept_hidden_layer: int, kernels: str = "native"):
        self.thinker = thinker
        self.text = thinker.model
        bi.check_activations(self.text)
        config = thinker.config.text_config
        if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
            raise NotImplementedError("the batched thinker decoder has no sliding-window attention")
        self.num_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if not 0 <= accept_hidden_layer < self.num_layers:
            raise ValueError(
                f"accept_hidden_layer {accept_hidden_layer} must name a layer below {self.num_layers}"
            )
        self.accept_hidden_layer = accept_hidden_layer
        self.kernels = check_kernels(kernels)

    @torch.no_grad()
    def prefill(
        self,
        prompts: list[list[int]],
        attention: StepAttention,
        starts: list[int] | None = None,
        inputs: list[torch.Tensor | None] | None = None,
    ) -> list[Prefilled]:
        """Text-only prompts (token ids, no multimodal placeholders) in one pass: every linear
        layer and the MoE on tiles over all their rows, attention causal within each prompt.
        A prompt's results do not depend on the others in the pass (the same premise as the
        decode step), so prompts arriving together cost one pass of fixed per-op overhead
        instead of one each (8 at once on this CPU: ~16 ms one by one).

        `starts[i]`: the first positions of prompt i are cached (the engine's `attention` knows
        where): only the rest is computed, attending to the cached keys, and the results (KV,
        rows) cover the rest only. They are bit for bit the rows the whole prompt's prefill
        computes: linear layers are row-invariant, attention too (`attend_rows`), and a cached
        position's KV is a function of the tokens up to it.

        `inputs[i]`: layer 0 of the positions computed for prompt i, where the embedding table
        alone does not give it (a prompt with audio: its encoder rows at the placeholders).
        Audio-only prompts keep text positions on all three rotary rows (transformers'
        `get_rope_index` gives them no offset), so the rotary below is theirs too."""
        starts = starts or [0] * len(prompts)
        inputs = inputs or [None] * len(prompts)
        if any(s >= len(ids) for s, ids in zip(starts, prompts)):
            raise ValueError("a cached prefix must leave at least one prompt position to compute")
        lengths = [len(ids) - start for ids, start in zip(prompts, starts)]
        h = torch.cat(
            [
                rows
                if rows is not None
                else self.text.embed_tokens(torch.tensor(p[start:], dtype=torch.long))
                for p, start, rows in zip(prompts, starts, inputs)
            ]
        )  # [N, hidden]
        if h.shape[0] != sum(lengths):
            raise ValueError("a prompt's layer-0 rows must cover the positions it computes")
        embeds, accept = h, None
        # Text-only prompts: the three multimodal rotary rows are all the text position.
        positions = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, lengths)])
        cos, sin = self.text.rotary_emb(h.unsqueeze(0), positions.view(1, 1, -1).expand(3, 1, -1))
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        for index, layer in enumerate(self.text.layers):
            h = bi.decoder_layer(layer, h, cos, sin, index, attention, self.head_dim, self.kernels)
            if index + 1 == self.accept_hidden_layer:
                accept = h
        if self.accept_hidden_layer == 0:
            accept = embeds
        last = torch.tensor([b - 1 for b in bounds[1:]])
        logits = bi.linear_module(self.thinker.lm_head, bi.norm(self.text.norm, h[last]))
        # Per prompt: its last position's logits and the rows of the positions it computed (layer
        # 0 and the accept layer; their KV the engine takes from `attention`); a text or audio
        # prompt has no rotary offset.
        return [
            Prefilled(
                logits[i],
                rows={"embeds": embeds[a:b].clone(), "hidden": accept[a:b].clone()},
                state={"rope_deltas": 0},
            )
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]

    @torch.no_grad()
    def step(self, rows: list[DecodeRow], attention: StepAttention) -> DecodeStepResult:
        count = len(rows)
        ids = torch.tensor([r.token for r in rows], dtype=torch.long)
        positions = torch.tensor([r.position for r in rows], dtype=torch.long)
        deltas = torch.tensor([r.rope_deltas for r in rows], dtype=torch.long)
        h = self.text.embed_tokens(ids)  # [B, hidden]
        embeds, accept = h, None
        # Text-only positions: the three multimodal rotary rows are all position + rope_deltas.
        rope_positions = (positions + deltas).view(1, count, 1).expand(3, count, 1)
        cos, sin = self.text.rotary_emb(h.unsqueeze(1), rope_positions)  # [B, 1, head_dim]
        for index, layer in enumerate(self.text.layers):
            h = h + self._attention(
                layer.self_attn, bi.norm(layer.input_layernorm, h), cos, sin, index, attention
            )
            h = h + bi.mlp(layer.mlp, bi.norm(layer.post_attention_layernorm, h), self.kernels)
            if index + 1 == self.accept_hidden_layer:
                accept = h
        if self.accept_hidden_layer == 0:
            accept = embeds
        logits = bi.linear_module(self.thinker.lm_head, bi.norm(self.text.norm, h))
        return DecodeStepResult(logits=logits, embeds=embeds, hidden=accept)

    def _attention(
        self,
        attn,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        attention: StepAttention,
    ) -> torch.Tensor:
        count, hd = x.shape[0], self.head_dim
        q = bi.norm(attn.q_norm, bi.linear_module(attn.q_proj, x).view(count, -1, hd)).unsqueeze(2)
        k = bi.norm(attn.k_norm, bi.linear_module(attn.k_proj, x).view(count, -1, hd)).unsqueeze(2)
        v = bi.linear_module(attn.v_proj, x).view(count, -1, hd)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # [B, heads, 1, hd]
        out = attention(layer, q[:, :, 0], k[:, :, 0], v, attn.scaling)
        return bi.linear_module(attn.o_proj, out)
