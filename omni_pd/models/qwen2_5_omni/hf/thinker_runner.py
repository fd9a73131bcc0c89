"""The Qwen2.5-Omni thinker as the generic engines run it: an `ArRunner` (engines/core/runner.py).

What is the thinker's own: the talker's input row of every position (prompt and fed-back output
tokens: thinker_forward.py says what it is), which travels beside the KV to a decode leg and in
the thinker's records (`ThinkerOutput`, `ThinkerChunk`). The engine does the rest.
Not yet taken: prompts with audio, images or video (refused by name when they arrive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from omni_pd.engines.core.attention import StepAttention
from omni_pd.engines.core.request import EngineRequest
from omni_pd.engines.core.runner import ArRunnerBase, DecodeResult, Prefilled, PrefillItem, RunnerIdentity
from omni_pd.engines.core.text import TextStops, sample_tokens
from omni_pd.engines.hf.attention_native import native_builds
from omni_pd.engines.hf.compute import HfCompute
from omni_pd.kv import BlockLayout
from omni_pd.kv.fingerprint import weights_digest
from omni_pd.sampling import SamplingParams

from ..records import ThinkerChunk, ThinkerOutput, ThinkerPrompt
from .thinker_forward import ThinkerForward

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
ROW = "talker_input"


@dataclass
class ThinkerState:
    """What the thinker keeps per request, beside the engine's record."""

    prompt_rows: torch.Tensor | None = None
    output_rows: list[torch.Tensor] = field(default_factory=list)
    rows_streamed: int = 0  # output rows already sent in chunks


class ThinkerRunner(ArRunnerBase):
    name = "thinker"
    caches_prefixes = True
    prefills_in_chunks = True

    def __init__(
        self, thinker: torch.nn.Module, tokenizer, eos_token_ids: frozenset[int], kernels: str = "native"
    ):
        self.thinker = thinker
        self.forward = ThinkerForward(thinker, kernels)
        self.compute = HfCompute(kernels)
        self.stops = TextStops(tokenizer, eos_token_ids)
        text = thinker.config.text_config
        self.width = text.hidden_size
        self.row_widths = {ROW: self.width}
        self.row_dtype = next(thinker.parameters()).dtype
        self.vocab_size = text.vocab_size

    @property
    def device(self) -> str:
        return str(next(self.thinker.parameters()).device)

    def kv_layout(self, block_size: int) -> BlockLayout:
        text = self.thinker.config.text_config
        return BlockLayout.default_for(
            text.num_hidden_layers,
            text.num_key_value_heads,
            self.forward.head_dim,
            _DTYPE_NAMES[self.row_dtype],
            block_size=block_size,
        )

    def identity(self) -> RunnerIdentity:
        config = self.thinker.config
        return RunnerIdentity(
            config.name_or_path or f"{config.model_type} ({type(self.thinker).__name__})",
            weights_digest(self.thinker.named_parameters()),
            self.device,
            native_builds(self.forward.kernels),
        )

    def describe(self) -> dict[str, Any]:
        return {"takes_multimodal_prompts": False}

    def new_request(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams) -> EngineRequest:
        if prompt.has_multimodal_inputs():
            raise ValueError(
                f"request {request_id}: omni-pd's Qwen2.5-Omni thinker takes text prompts only so "
                "far; send the request without audio"
            )
        ids = [int(t) for t in prompt.prompt_token_ids]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(
                f"request {request_id}: a prompt token id is outside the vocabulary of {self.vocab_size} ids"
            )
        request = EngineRequest(request_id, prompt, params, prompt_len=len(ids), token_ids=ids)
        request.model = ThinkerState()
        return request

    # ---- compute -------------------------------------------------------------------------------
    def prefill(self, items: Sequence[PrefillItem], attention: StepAttention) -> list[Prefilled]:
        return self.forward.prefill(
            [i.request.token_ids[: i.end] for i in items],
            attention,
            [i.start for i in items],
            [None] * len(items),
        )

    def prefill_alone(self, request: EngineRequest) -> Prefilled:
        raise RuntimeError("every text prompt of the Qwen2.5-Omni thinker is batchable")

    def decode(self, requests: Sequence[EngineRequest], attention: StepAttention) -> DecodeResult:
        result = self.forward.step(
            [r.tokens[-1] for r in requests], [r.position for r in requests], attention
        )
        for b, request in enumerate(requests):
            if request.rows:  # a text-only request's rows have no reader
                request.model.output_rows.append(result.rows[b].clone())
        return DecodeResult(result.logits)

    def sample(
        self, requests: Sequence[EngineRequest], logits: torch.Tensor, first: bool
    ) -> list[int | Exception]:
        return list(sample_tokens(requests, logits, first))

    def prefilled(self, request: EngineRequest, result: Prefilled) -> None:
        request.model.prompt_rows = result.rows[ROW]

    def restart(self, request: EngineRequest) -> None:
        request.model.prompt_rows = None
        request.model.output_rows = []  # rows_streamed: what was sent

    # ---- results -------------------------------------------------------------------------------
    def finish_reason(self, request: EngineRequest) -> str | None:
        return self.stops.finish_reason(request.tokens, request.params)

    def _rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows) if rows else torch.zeros((0, self.width), dtype=self.row_dtype)

    def output(self, request: EngineRequest, reason: str) -> ThinkerOutput:
        state = request.model
        # A prefill leg's output is the prompt's (its first token only); a decode leg's prompt
        # rows stay with its prefill leg.
        generated = not request.publishes
        return ThinkerOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.token_ids),
            token_ids=list(request.tokens),
            text=self.stops.detokenize(request.tokens, request.params) if generated else "",
            finish_reason=reason,
            prompt_rows=state.prompt_rows if request.prefills_here and request.rows else None,
            output_rows=self._rows(state.output_rows) if generated and request.rows else None,
            output_start=request.prompt_len,
            metrics=dict(request.metrics),
        )

    def chunk(self, request: EngineRequest, new_tokens: list[int], first: bool, finished: bool) -> Any:
        """For a talker that runs alongside: the new tokens and the rows fed back since the last."""
        if not request.chunks:
            return None
        state = request.model
        chunk = ThinkerChunk(
            token_ids=list(new_tokens),
            rows=self._rows(state.output_rows[state.rows_streamed :]),
            start=request.prompt_len + state.rows_streamed,
            prompt_token_ids=list(request.token_ids) if first else None,
            prompt_rows=state.prompt_rows if first else None,
        )
        state.rows_streamed = len(state.output_rows)
        return chunk
