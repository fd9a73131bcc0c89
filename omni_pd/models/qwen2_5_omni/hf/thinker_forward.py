"""Qwen2.5-Omni's thinker, batched: prompts admitted together, and one decode step for every
running request.

They compute what transformers' thinker text model computes (its dense Qwen2 layers: q/k/v with
biases and no q/k norms, the multimodal rotary of concatenated sections, a gated MLP, the final
norm), but batch-invariantly: every linear layer goes through `batch_invariant` (fixed row tiles)
and attention is the engine's (engines/core/attention.py), so a request's bits do not depend on
its batch. Text and audio positions sit on all three rotary rows alike (transformers'
`get_rope_index` gives them no offset); prompts with images or video are refused by the runner.

Besides logits, each pass gives the talker's input row of every position it computes: the last
hidden state after the final norm plus the position's token embedding (zero at audio
placeholders), the sum transformers' `generate` feeds its talker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_pd.engines.core.attention import StepAttention
from omni_pd.engines.core.runner import Prefilled
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.attention_native import check_kernels


@dataclass
class StepResult:
    logits: torch.Tensor  # [B, vocab]
    rows: torch.Tensor  # [B, hidden]: the talker's input row of each fed-in token


class ThinkerForward:
    def __init__(self, thinker: torch.nn.Module, kernels: str = "native"):
        self.thinker = thinker
        self.text = thinker.model
        bi.check_activations(self.text)
        config = thinker.config.text_config
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("the batched thinker has no sliding-window attention")
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.kernels = check_kernels(kernels)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """The decoder layers over the step's new rows `h` ([rows, hidden]), then the final norm."""
        # [1, rows, head_dim]: the three rotary sections of a text or audio row share its position.
        cos, sin = self.text.rotary_emb(h.unsqueeze(0), positions.view(1, -1))
        for index, layer in enumerate(self.text.layers):
            h = bi.decoder_layer(layer, h, cos, sin, index, attention, self.head_dim, self.kernels)
        return bi.norm(self.text.norm, h)

    @torch.no_grad()
    def prefill(
        self,
        prompts: list[list[int]],
        attention: StepAttention,
        starts: list[int],
        inputs: list[tuple[torch.Tensor, torch.Tensor] | None],
    ) -> list[Prefilled]:
        """Prompts in one pass; prompt i computes positions starts[i] .. (its earlier ones are
        cached, and the engine's `attention` knows where). `inputs[i]`: for a prompt with audio,
        (layer 0 of the positions it computes, their talker embeddings: zero at audio); None for
        text, whose rows the embedding table gives."""
        lengths = [len(ids) - start for ids, start in zip(prompts, starts)]
        if min(lengths) < 1:
            raise ValueError("a cached prefix must leave at least one prompt position to compute")
        layer0, embeds = [], []
        for ids, start, given in zip(prompts, starts, inputs):
            if given is None:
                rows = self.text.embed_tokens(torch.tensor(ids[start:], dtype=torch.long))
                given = (rows, rows)
            layer0.append(given[0])
            embeds.append(given[1])
        positions = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, lengths)])
        hidden = self._layers(torch.cat(layer0), positions, attention)
        rows = hidden + torch.cat(embeds)
        bounds = torch.tensor(lengths).cumsum(0)
        logits = bi.linear_module(self.thinker.lm_head, hidden[bounds - 1])
        return [
            Prefilled(logits[i], rows={"talker_input": rows[int(b) - n : int(b)].clone()})
            for i, (b, n) in enumerate(zip(bounds, lengths))
        ]

    @torch.no_grad()
    def step(self, tokens: list[int], positions: list[int], attention: StepAttention) -> StepResult:
        embeds = self.text.embed_tokens(torch.tensor(tokens, dtype=torch.long))
        hidden = self._layers(embeds, torch.tensor(positions, dtype=torch.long), attention)
        return StepResult(bi.linear_module(self.thinker.lm_head, hidden), hidden + embeds)
