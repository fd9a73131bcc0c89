"""The dense Qwen3 text model on omni-pd's hf engines: its `ArRunner` (engines/core/runner.py).

What is Qwen3's own is its forward pass: token embeddings, per layer RMSNorm, attention with
q/k norms and rotary positions, a gated MLP, the final norm and the LM head. Every linear layer
runs on the batch-invariant tiles and attention is the engine's call (engines/core/attention.py:
a prompt's rows over its cached prefix, a decode step's over its cache, on the native kernel or
torch's), so a request's bits do not depend on its batch, and P/D (the engines' generic legs)
equals colocated.
Prompts are token ids only (audio or images are refused by name).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from omni_pd.engines.core.attention import StepAttention
from omni_pd.engines.core.request import EngineRequest
from omni_pd.engines.core.runner import ArRunnerBase, DecodeResult, Prefilled, PrefillItem, RunnerIdentity
from omni_pd.engines.core.text import TextStops, sample_tokens
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.attention_native import native_builds
from omni_pd.engines.hf.compute import HfCompute
from omni_pd.engines.types import TextOutput
from omni_pd.kv import BlockLayout
from omni_pd.kv.fingerprint import weights_digest
from omni_pd.sampling import SamplingParams

DTYPES = {
    "auto": torch.float32,
    "float": torch.float32,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class Qwen3TextRunner(ArRunnerBase):
    caches_prefixes = True
    prefills_in_chunks = True  # `prefill` computes positions start .. end (PrefillItem.end)

    def __init__(self, llm: torch.nn.Module, tokenizer, name: str, kernels: str = "native"):
        self.llm, self.text = llm, llm.model
        self.name = name  # the stage's model_stage
        config = llm.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.compute = HfCompute(kernels)
        self.kernels = self.compute.name
        bi.check_activations(self.text)
        eos = config.eos_token_id
        self.stops = TextStops(tokenizer, eos if isinstance(eos, list) else [eos])

    @property
    def device(self) -> str:
        return str(next(self.llm.parameters()).device)

    def kv_layout(self, block_size: int) -> BlockLayout:
        config = self.llm.config
        return BlockLayout.default_for(
            config.num_hidden_layers,
            config.num_key_value_heads,
            self.head_dim,
            _NAMES[next(self.llm.parameters()).dtype],
            block_size=block_size,
        )

    def identity(self) -> RunnerIdentity:
        config = self.llm.config
        return RunnerIdentity(
            config.name_or_path or config.model_type,
            weights_digest(self.llm.named_parameters()),
            self.device,
            native_builds(self.kernels),
        )

    def describe(self) -> dict[str, Any]:
        return {"takes_multimodal_prompts": False}

    def new_request(self, request_id: str, prompt: Any, params: SamplingParams) -> EngineRequest:
        if getattr(prompt, "has_multimodal_inputs", lambda: False)():
            raise ValueError(
                f"request {request_id}: stage {self.name} runs a text-only Qwen3, which "
                "takes token ids only; send a prompt without audio or images"
            )
        ids = [int(t) for t in prompt.prompt_token_ids]
        vocab = self.llm.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(
                f"request {request_id}: a prompt token id is outside the vocabulary of {vocab} ids"
            )
        return EngineRequest(request_id, prompt, params, prompt_len=len(ids), token_ids=ids)

    # ---- the forward passes --------------------------------------------------------------------
    def _rotary(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))  # [1, rows, hd] each

    @torch.no_grad()
    def prefill(self, items: Sequence[PrefillItem], attention: StepAttention) -> list[Prefilled]:
        starts = [item.start for item in items]
        prompts = [item.request.token_ids[: item.end] for item in items]
        lengths = [len(ids) - start for ids, start in zip(prompts, starts)]
        h = self.text.embed_tokens(torch.tensor([t for ids, s in zip(prompts, starts) for t in ids[s:]]))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        h = self._layers(h, self._rotary(h, positions), attention)
        last = torch.tensor(lengths).cumsum(0) - 1
        logits = bi.linear_module(self.llm.lm_head, bi.norm(self.text.norm, h[last]))
        return [Prefilled(logits[i]) for i in range(len(items))]  # KV: the engine's, from `attention`

    def prefill_alone(self, request: EngineRequest) -> Prefilled:
        raise RuntimeError("every prompt of the text model is batchable")

    @torch.no_grad()
    def decode(self, requests: Sequence[EngineRequest], attention: StepAttention) -> DecodeResult:
        h = self.text.embed_tokens(torch.tensor([r.tokens[-1] for r in requests]))
        h = self._layers(h, self._rotary(h, torch.tensor([r.position for r in requests])), attention)
        return DecodeResult(bi.linear_module(self.llm.lm_head, bi.norm(self.text.norm, h)))

    def _layers(
        self, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attention: StepAttention
    ) -> torch.Tensor:
        """The decoder layers over the step's new rows `h` ([rows, hidden], in sequence order)."""
        cos, sin = rotary
        for index, layer in enumerate(self.text.layers):
            h = bi.decoder_layer(layer, h, cos, sin, index, attention, self.head_dim, self.kernels)
        return h

    def sample(
        self, requests: Sequence[EngineRequest], logits: torch.Tensor, first: bool
    ) -> list[int | Exception]:
        return list(sample_tokens(requests, logits, first))

    # ---- results -------------------------------------------------------------------------------
    def finish_reason(self, request: EngineRequest) -> str | None:
        return self.stops.finish_reason(request.tokens, request.params)

    def output(self, request: EngineRequest, reason: str) -> TextOutput:
        text = "" if request.publishes else self.stops.detokenize(request.tokens, request.params)
        return TextOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.token_ids),
            token_ids=list(request.tokens),
            text=text,
            finish_reason=reason,
            metrics=dict(request.metrics),
        )

    def chunk(self, request: EngineRequest, new_tokens: list[int], first: bool, finished: bool) -> Any:
        return None  # text deltas only: no stage runs alongside
