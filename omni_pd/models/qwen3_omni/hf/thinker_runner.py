"""The Qwen3-Omni thinker as the generic engines run it: an `ArRunner` (engines/core/runner.py).

What is the thinker's own: its prompts carry audio (each clip encoded alone, its features' hash
naming the blocks it covers) and sometimes images or video (whose 3D rotary the batched pass does
not compute: those prompts run alone through transformers' forward, and their rotary offset,
`rope_deltas`, travels to a decode leg); the talker needs two rows per position (layer 0 and the
accept layer), for the prompt and for every generated token fed back; and its records
(`ThinkerOutput`, `ThinkerChunk`). The engine does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from omni_pd.engines.core.attention import StepAttention
from omni_pd.engines.core.request import EngineRequest
from omni_pd.engines.core.runner import ArRunnerBase, DecodeResult, Prefilled, PrefillItem, RunnerIdentity
from omni_pd.engines.hf.attention_native import native_builds
from omni_pd.engines.hf.compute import HfCompute
from omni_pd.engines.core.text import sample_tokens
from omni_pd.kv import BlockLayout
from omni_pd.kv.fingerprint import weights_digest
from omni_pd.models.qwen3_omni.records import ThinkerChunk, ThinkerOutput, ThinkerPrompt
from omni_pd.sampling import SamplingParams
from .thinker_model import AudioClip, ThinkerModel
from .thinker_forward import ThinkerForward, DecodeRow

_TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
ROWS = ("embeds", "hidden")  # layer 0 and the talker's accept layer, per position


def cache_to_canonical(cache) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] from a batch-of-one DynamicCache."""
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def thinker_layout(thinker, block_size: int) -> BlockLayout:
    text = thinker.config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = _TORCH_TO_NAME[next(thinker.parameters()).dtype]
    return BlockLayout.default_for(
        text.num_hidden_layers, text.num_key_value_heads, head_dim, dtype, block_size=block_size
    )


def model_name(thinker: torch.nn.Module) -> str:
    """What the engine knows of its model: the checkpoint path, else (dummy weights) the config's
    model type and the module's class."""
    config = thinker.config
    return config.name_or_path or f"{config.model_type} ({type(thinker).__name__})"


@dataclass
class ThinkerState:
    """What the thinker keeps per request, beside the engine's record."""

    clips: list[AudioClip] = field(default_factory=list)  # the prompt's audio inputs
    rope_deltas: int = 0
    prompt_embeds: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    output_embeds: list[torch.Tensor] = field(default_factory=list)
    output_hidden: list[torch.Tensor] = field(default_factory=list)
    rows_streamed: int = 0  # output rows already sent in chunks


class ThinkerRunner(ArRunnerBase):
    name = "thinker"
    caches_prefixes = True
    prefills_in_chunks = True
    handoff_keys = ("rope_deltas",)

    def __init__(self, runner: ThinkerModel, kernels: str = "native"):
        self.runner = runner
        self.thinker = runner.thinker
        self.decoder = ThinkerForward(runner.thinker, runner.accept_hidden_layer, kernels)
        self.compute = HfCompute(kernels)
        self.width = runner.text_config.hidden_size
        self.row_widths = {name: self.width for name in ROWS}
        self.row_dtype = next(runner.thinker.parameters()).dtype
        config = runner.thinker.config
        # Images and video need the 3D rotary, which the batched pass does not compute.
        self._vision_ids = frozenset(
            getattr(config, name)
            for name in ("image_token_id", "video_token_id")
            if getattr(config, name, None) is not None
        )

    @property
    def device(self) -> str:
        return str(next(self.thinker.parameters()).device)

    def kv_layout(self, block_size: int) -> BlockLayout:
        return thinker_layout(self.thinker, block_size)

    def identity(self) -> RunnerIdentity:
        return RunnerIdentity(
            model_name(self.thinker),
            weights_digest(self.thinker.named_parameters()),
            self.device,
            native_builds(self.decoder.kernels),
        )

    def new_request(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams) -> EngineRequest:
        ids = list(prompt.prompt_token_ids)
        request = EngineRequest(request_id, prompt, params, prompt_len=len(ids), token_ids=ids)
        # Audio inputs are placed and hashed now: a malformed prompt fails here, alone.
        clips = self.runner.audio_clips(prompt)
        request.multimodal_spans = [(c.start, c.end, c.key) for c in clips]
        request.batchable = self._vision_ids.isdisjoint(ids)
        request.model = ThinkerState(clips=clips)
        return request

    # ---- compute -------------------------------------------------------------------------------
    def _layer0(self, request: EngineRequest, start: int, end: int | None = None) -> torch.Tensor | None:
        """Layer 0 of the positions a prompt with audio computes (after its cached prefix), its
        audio encoded here; None for text, whose rows the batched pass looks up itself."""
        if not request.model.clips:
            return None
        rows = self.runner.layer0_rows(request.prompt, request.model.clips, start)
        return rows if end is None else rows[: end - start]

    def prefill(self, items: Sequence[PrefillItem], attention: StepAttention) -> list[Prefilled]:
        return self.decoder.prefill(
            [i.request.prompt.prompt_token_ids[: i.end] for i in items],
            attention,
            [i.start for i in items],
            [self._layer0(i.request, i.start, i.end) for i in items],
        )

    def prefill_alone(self, request: EngineRequest) -> Prefilled:
        run = self.runner.prefill(request.prompt, request.params)
        return Prefilled(
            run.logits,
            cache_to_canonical(run.cache),
            {"embeds": run.prompt_embeds, "hidden": run.prompt_hidden},
            {"rope_deltas": run.rope_deltas},
        )

    def decode(self, requests: Sequence[EngineRequest], attention: StepAttention) -> DecodeResult:
        rows = [DecodeRow(r.tokens[-1], r.position, r.model.rope_deltas) for r in requests]
        result = self.decoder.step(rows, attention)
        for b, request in enumerate(requests):
            if request.rows:  # a text-only request's rows have no reader
                request.model.output_embeds.append(result.embeds[b].clone())
                request.model.output_hidden.append(result.hidden[b].clone())
        return DecodeResult(result.logits)

    def sample(
        self, requests: Sequence[EngineRequest], logits: torch.Tensor, first: bool
    ) -> list[int | Exception]:
        return list(sample_tokens(requests, logits, first))

    def prefilled(self, request: EngineRequest, result: Prefilled) -> None:
        state = request.model
        state.rope_deltas = result.state["rope_deltas"]
        state.prompt_embeds, state.prompt_hidden = result.rows["embeds"], result.rows["hidden"]

    def resume(self, request: EngineRequest, state: Mapping[str, int]) -> None:
        request.model.rope_deltas = state["rope_deltas"]

    def restart(self, request: EngineRequest) -> None:
        state = request.model
        state.prompt_embeds = state.prompt_hidden = None
        state.output_embeds, state.output_hidden = [], []  # rows_streamed: what was sent

    # ---- results -------------------------------------------------------------------------------
    def finish_reason(self, request: EngineRequest) -> str | None:
        return self.runner.finish_reason(request.tokens, request.params)

    def _rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows) if rows else torch.zeros((0, self.width))

    def output(self, request: EngineRequest, reason: str) -> ThinkerOutput:
        state = request.model
        # A prefill leg's output is the prompt's (its first token only); a decode leg's prompt
        # rows stay with its prefill leg.
        generated = not request.publishes
        prompt_rows = request.prefills_here and request.rows
        output_rows = generated and request.rows
        return ThinkerOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.token_ids),
            token_ids=list(request.tokens),
            text=self.runner.detokenize(request.tokens, request.params) if generated else "",
            finish_reason=reason,
            prompt_embeds=state.prompt_embeds if prompt_rows else None,
            prompt_hidden=state.prompt_hidden if prompt_rows else None,
            output_embeds=self._rows(state.output_embeds) if output_rows else None,
            output_hidden=self._rows(state.output_hidden) if output_rows else None,
            output_start=request.prompt_len,
            metrics=dict(request.metrics),
        )

    def chunk(self, request: EngineRequest, new_tokens: list[int], first: bool, finished: bool) -> Any:
        """For a talker that runs alongside, a chunk with the new tokens and the rows of the
        tokens fed back since the last one."""
        if not request.chunks:
            return None
        state = request.model
        rows = state.output_embeds[state.rows_streamed :]
        chunk = ThinkerChunk(
            token_ids=list(new_tokens),
            embeds=torch.stack(rows) if rows else torch.zeros((0, self.width)),
            start=request.prompt_len + state.rows_streamed,
            prompt_token_ids=list(request.token_ids) if first else None,
            prompt_embeds=state.prompt_embeds if first else None,
            prompt_hidden=state.prompt_hidden if first else None,
        )
        state.rows_streamed = len(state.output_embeds)
        return chunk
