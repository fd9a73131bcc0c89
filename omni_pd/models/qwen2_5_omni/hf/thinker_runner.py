"""The Qwen2.5-Omni thinker as the generic engines run it: an `ArRunner` (engines/core/runner.py).

What is the thinker's own: prompts with audio (each clip encoded alone by the audio tower, its
rows at its placeholders; its features' hash names the blocks it covers), and the talker's input
row of every position (prompt and fed-back output tokens: thinker_forward.py says what it is),
which travels beside the KV to a decode leg and in the thinker's records (`ThinkerOutput`,
`ThinkerChunk`). The engine does the rest. Images and video are refused by name.
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

from omni_pd.models.omni_prompt import AudioClip, audio_clips, encode_clip

from ..prompt import audio_token_count
from ..records import ThinkerChunk, ThinkerOutput, ThinkerPrompt
from .thinker_forward import ThinkerForward

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
ROW = "talker_input"


@dataclass
class ThinkerState:
    """What the thinker keeps per request, beside the engine's record."""

    clips: list[AudioClip] = field(default_factory=list)  # the prompt's audio inputs
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
        config = thinker.config
        self.audio_token_id = config.audio_token_index
        self.vision_ids = frozenset((config.image_token_index, config.video_token_index))

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
        return {"takes_multimodal_prompts": True}

    def new_request(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams) -> EngineRequest:
        ids = [int(t) for t in prompt.prompt_token_ids]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(
                f"request {request_id}: a prompt token id is outside the vocabulary of {self.vocab_size} ids"
            )
        if not self.vision_ids.isdisjoint(ids):
            raise ValueError(
                f"request {request_id}: omni-pd's Qwen2.5-Omni thinker takes text and audio; send the "
                "request without images or video"
            )
        request = EngineRequest(request_id, prompt, params, prompt_len=len(ids), token_ids=ids)
        # Audio inputs are placed and hashed now: a malformed prompt fails here, alone.
        clips = audio_clips(prompt, self.audio_token_id, audio_token_count)
        request.multimodal_spans = [(c.start, c.end, c.key) for c in clips]
        request.model = ThinkerState(clips=clips)
        return request

    @torch.no_grad()
    def _inputs(
        self, request: EngineRequest, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a prompt with audio, positions start .. end's layer 0 (each clip that reaches them
        encoded alone, its rows at its placeholders, as transformers' forward merges them) and
        their talker embeddings (zero at the placeholders, as transformers' generate masks them);
        None for text, whose rows the embedding table gives."""
        clips = request.model.clips
        if not clips:
            return None
        prompt = request.prompt
        layer0 = self.thinker.model.embed_tokens(torch.tensor(request.token_ids[start:end], dtype=torch.long))
        talker = layer0.clone()
        for clip in clips:
            lo, hi = max(clip.start, start), min(clip.end, end)
            if lo >= hi:
                continue
            try:
                encoded = encode_clip(self.thinker, prompt, clip, layer0.dtype)
            except ValueError as exc:
                raise ValueError(f"request {request.request_id}: {exc}") from None
            layer0[lo - start : hi - start] = encoded[lo - clip.start : hi - clip.start]
            talker[lo - start : hi - start] = 0
        return layer0, talker

    # ---- compute -------------------------------------------------------------------------------
    def prefill(self, items: Sequence[PrefillItem], attention: StepAttention) -> list[Prefilled]:
        ends = [i.end if i.end is not None else i.request.prompt_len for i in items]
        return self.forward.prefill(
            [i.request.token_ids[:end] for i, end in zip(items, ends)],
            attention,
            [i.start for i in items],
            [self._inputs(i.request, i.start, end) for i, end in zip(items, ends)],
        )

    def prefill_alone(self, request: EngineRequest) -> Prefilled:
        raise RuntimeError("every prompt of the Qwen2.5-Omni thinker (text, audio) is batchable")

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
