"""Qwen2.5-Omni's talker as the generic engines run it: an `ArRunner` (engines/core/runner.py).

Semantics follow `Qwen2_5OmniForConditionalGeneration.generate` (transformers 5.19): the talker's
prompt is, per thinker prompt position, the thinker's talker row (records.py), then the voice's
bos token embedded by the thinker's table, then the row of the first generated token; the codec
pad and bos embeddings are added to the last two. Each decode step feeds the previous code's codec
embedding plus the next reply row: the rows of the thinker's later fed-back tokens, then the
`tts_text_eod` embedding, then `tts_text_pad` for as long as it speaks. Every row goes through
`thinker_to_talker_proj`, the decoder layers and the codec head. The repetition penalty counts the
prompt's codec ids ([mask] * P, pad, bos) and the codes so far, bos is never sampled, codec pad
or end stops it, and the codes are those before the stop.

Many requests per step, each computed on the batch-invariant tiles with the engine's attention,
so a request's codes do not depend on its batch; draws are keyed by the request's seed and step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from omni_pd.engines.core.attention import StepAttention
from omni_pd.engines.core.request import EngineRequest
from omni_pd.engines.core.runner import ArRunnerBase, DecodeResult, Prefilled, PrefillItem, RunnerIdentity
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.attention_native import native_builds
from omni_pd.engines.hf.compute import HfCompute
from omni_pd.kv import BlockLayout
from omni_pd.kv.fingerprint import weights_digest
from omni_pd.models.codec_sampling import RowSampling, process_code0_scores, sample_rows
from omni_pd.sampling import SamplingParams

from ..factory import find_voice
from ..records import TalkerInputDelta, TalkerOutput, TalkerPrompt

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class TalkerState:
    """What the talker keeps per request, beside the engine's record (whose `tokens` are the
    codes sampled, the stop included)."""

    inputs: torch.Tensor  # [P + 2, thinker hidden]: the prompt rows, before the projection
    reply: torch.Tensor  # [R, thinker hidden]: one per decode step, the last repeated
    # The reply's last rows (`tts_text_eod`, `tts_text_pad`), appended once the thinker is done:
    # a talker started while its thinker runs gets the reply rows as they come, and a decode
    # step waits for its row (`ready`), so its codes are those of the whole output.
    tail: torch.Tensor | None = None
    thinker_tokens: int = 0  # the thinker's generated tokens so far
    # The prompt's distinct codec ids (mask, pad, bos): what the repetition penalty counts of
    # the prompt (it applies once per id, so each is listed once, not P times a step).
    prompt_codes: tuple[int, ...] = ()
    logits: list[torch.Tensor] | None = None  # each step's raw logits, when the runner traces (tests)
    codes_sent: int = 0  # codes already streamed to token2wav


class Voices:
    """The voices' bos tokens (spk_dict.pt's), found as `factory.find_voice` finds a voice."""

    def __init__(self, speakers: dict[str, dict[str, Any]]):
        self.speakers = speakers

    def bos_token(self, voice: str | None) -> int:
        return int(find_voice(self.speakers, voice)["bos_token"])


class TalkerRunner(ArRunnerBase):
    name = "talker"
    emits_text = False  # codec codes: they leave as the talker's output, not as text
    prefills_in_chunks = True

    def __init__(
        self,
        talker: torch.nn.Module,
        thinker_embedding: torch.nn.Module,
        voices: Voices,
        kernels: str = "native",
        trace: bool = False,
    ):
        self.talker, self.model = talker, talker.model
        self.trace = trace
        self.thinker_embedding = thinker_embedding
        self.voices = voices
        bi.check_activations(talker)
        config = talker.config
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.stops = (config.tts_codec_pad_token_id, config.tts_codec_end_token_id)
        self.suppress_mask = torch.zeros(config.vocab_size, dtype=torch.bool)
        self.suppress_mask[config.tts_codec_start_token_id] = True
        self.compute = HfCompute(kernels)
        self.kernels = self.compute.name

    @property
    def device(self) -> str:
        return str(next(self.talker.parameters()).device)

    def kv_layout(self, block_size: int) -> BlockLayout:
        dtype = _DTYPE_NAMES[next(self.talker.parameters()).dtype]
        return BlockLayout.default_for(
            self.config.num_hidden_layers,
            self.config.num_key_value_heads,
            self.head_dim,
            dtype,
            block_size=block_size,
        )

    def identity(self) -> RunnerIdentity:
        named = list(self.talker.named_parameters()) + [
            (f"thinker_embedding.{n}", p) for n, p in self.thinker_embedding.named_parameters()
        ]
        return RunnerIdentity(
            self.config.name_or_path or "qwen2_5_omni talker",
            weights_digest(named),
            self.device,
            native_builds(self.kernels),
        )

    def describe(self) -> dict[str, Any]:
        return {"takes_multimodal_prompts": False}

    # ---- the request ---------------------------------------------------------------------------
    @torch.no_grad()
    def _embed_text(self, ids: list[int]) -> torch.Tensor:
        return self.thinker_embedding(torch.tensor(ids, dtype=torch.long))

    @torch.no_grad()
    def _embed_codes(self, ids: list[int]) -> torch.Tensor:
        return self.model.embed_tokens(torch.tensor(ids, dtype=torch.long))

    def new_request(self, request_id: str, prompt: TalkerPrompt, params: SamplingParams) -> EngineRequest:
        """A request from the thinker's whole output (`prompt.final`), or from its first part while
        it runs: the prompt rows and the first fed-back token's row (later rows arrive through
        `append_input`)."""
        bos = self.voices.bos_token(prompt.speaker)  # ValueError naming the voices
        length = len(prompt.prompt_token_ids)
        fed = len(prompt.output_token_ids) - 1  # the last generated token is never fed back
        if fed < 1:
            raise ValueError(
                f"request {request_id}: the talker needs at least two thinker tokens (it starts "
                f"from the row of the first one fed back); the thinker gave {len(prompt.output_token_ids)}"
            )
        if prompt.rows.shape[0] != length + fed:
            raise ValueError(
                f"request {request_id}: the thinker rows cover {prompt.rows.shape[0]} positions, "
                f"expected {length + fed} (prompt {length} + fed-back tokens {fed})"
            )
        config = self.config
        special = self._embed_text([bos, config.tts_text_end_token_id, config.tts_text_pad_token_id])
        rows = prompt.rows.to(special.dtype)
        inputs = torch.cat([rows[:length], special[:1], rows[length : length + 1]])
        codec = self._embed_codes([config.tts_codec_pad_token_id, config.tts_codec_start_token_id])
        inputs[-2] += codec[0]
        inputs[-1] += codec[1]
        codec_prompt = [config.tts_codec_mask_token_id] * length + [
            config.tts_codec_pad_token_id,
            config.tts_codec_start_token_id,
        ]
        state = TalkerState(
            inputs=inputs.contiguous(),
            reply=rows[length + 1 :].contiguous(),
            tail=special[1:].contiguous(),
            thinker_tokens=len(prompt.output_token_ids),
            prompt_codes=tuple(sorted(set(codec_prompt))),
            logits=[] if self.trace else None,
        )
        if prompt.final:
            self._complete(state)
        return EngineRequest(
            request_id, prompt, params, prompt_len=length + 2, token_ids=codec_prompt, model=state
        )

    @staticmethod
    def _complete(state: TalkerState) -> None:
        assert state.tail is not None
        state.reply, state.tail = torch.cat([state.reply, state.tail]), None

    def append_input(self, request: EngineRequest, data: TalkerInputDelta, final: bool) -> None:
        """More of the thinker's output: the rows of the tokens it fed back since; with `final`,
        the reply's closing rows, and a check that every fed-back token's row came."""
        state = request.model
        if state.tail is None:
            raise ValueError(f"request {request.request_id}: thinker output arrived after the last of it")
        if data.rows.shape[0]:
            state.reply = torch.cat([state.reply, data.rows.to(state.reply.dtype)])
        state.thinker_tokens += len(data.output_token_ids)
        if final:
            # Fed back: every generated token but the last; the first one's row is in the prompt.
            expected = state.thinker_tokens - 2
            if state.reply.shape[0] != expected:
                raise ValueError(
                    f"request {request.request_id}: the thinker streamed {state.reply.shape[0]} reply "
                    f"rows for {state.thinker_tokens} tokens; expected {expected}"
                )
            self._complete(state)

    def ready(self, request: EngineRequest) -> bool:
        """Its next step's reply row is there (or the reply is complete)."""
        state = request.model
        return state.tail is None or len(request.tokens) - 1 < state.reply.shape[0]

    def restart(self, request: EngineRequest) -> None:
        """Computed again from its prompt: its inputs and reply rows stay; its traced logits go
        (codes_sent: what token2wav already has)."""
        if request.model.logits is not None:
            request.model.logits = []

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor, positions: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """Rows in the thinker's space -> the codec head's logits ([rows, vocab])."""
        h = bi.linear_module(self.talker.thinker_to_talker_proj, x)
        # Text positions: the three rotary sections share one position.
        cos, sin = self.model.rotary_emb(h.unsqueeze(0), positions.view(1, -1))
        for index, layer in enumerate(self.model.layers):
            h = bi.decoder_layer(layer, h, cos, sin, index, attention, self.head_dim, self.kernels)
        return bi.linear_module(self.talker.codec_head, bi.norm(self.model.norm, h)).float()

    @torch.no_grad()
    def prefill(self, items: Sequence[PrefillItem], attention: StepAttention) -> list[Prefilled]:
        spans = [(i.start, i.end if i.end is not None else i.request.prompt_len) for i in items]
        x = torch.cat([i.request.model.inputs[a:b] for i, (a, b) in zip(items, spans)])
        positions = torch.cat([torch.arange(a, b) for a, b in spans])
        logits = self._forward(x, positions, attention)
        last = torch.tensor([b - a for a, b in spans]).cumsum(0) - 1
        return [Prefilled(logits[int(j)]) for j in last]

    def prefill_alone(self, request: EngineRequest) -> Prefilled:
        raise RuntimeError("every talker prompt is batchable")

    @torch.no_grad()
    def decode(self, requests: Sequence[EngineRequest], attention: StepAttention) -> DecodeResult:
        codes = self._embed_codes([r.tokens[-1] for r in requests])
        reply = torch.stack(
            [r.model.reply[min(len(r.tokens) - 1, r.model.reply.shape[0] - 1)] for r in requests]
        )
        positions = torch.tensor([r.position for r in requests])
        return DecodeResult(self._forward(codes + reply, positions, attention))

    def sample(
        self, requests: Sequence[EngineRequest], logits: torch.Tensor, first: bool
    ) -> list[int | Exception]:
        for request, row in zip(requests, logits):
            if request.model.logits is not None:
                request.model.logits.append(row.clone())
        scores = process_code0_scores(
            logits,
            [list(r.model.prompt_codes) + list(r.tokens) for r in requests],
            [r.params.repetition_penalty for r in requests],
            self.suppress_mask,
            [r.params.ignore_eos for r in requests],
            self.stops,  # ignore_eos: neither codec pad nor end is sampled
        )
        specs = [
            RowSampling(
                r.params.greedy,
                r.params.temperature,
                max(r.params.top_k, 0),
                r.params.top_p,
                r.params.seed if r.params.seed is not None else 0,
                len(r.tokens),
            )
            for r in requests
        ]
        return list(sample_rows(scores, specs))

    # ---- results -------------------------------------------------------------------------------
    def finish_reason(self, request: EngineRequest) -> str | None:
        if request.tokens[-1] in self.stops:
            return "stop"
        if len(request.tokens) >= request.params.max_tokens:
            return "length"
        return None

    def output(self, request: EngineRequest, reason: str) -> TalkerOutput:
        codes = list(request.tokens)
        if codes and codes[-1] in self.stops:
            codes = codes[:-1]
        traced = request.model.logits
        return TalkerOutput(
            request.request_id,
            torch.tensor(codes, dtype=torch.long),
            dict(request.metrics),
            torch.stack(traced) if traced else None,
        )

    def chunk(self, request: EngineRequest, new_tokens: list[int], first: bool, finished: bool) -> Any:
        """The codes to stream to token2wav now (the stop excluded): none until a whole chunk of
        them is there (`chunk_sizes`, the downstream's), or the request is done."""
        if not request.chunks:
            return None
        codes = list(request.tokens)
        if codes and codes[-1] in self.stops:
            codes = codes[:-1]
        state = request.model
        if request.chunk_sizes is not None and not finished:
            due = request.chunk_sizes[0] if state.codes_sent == 0 else request.chunk_sizes[1]
            if len(codes) - state.codes_sent < due:
                return None
        if len(codes) == state.codes_sent:
            return None
        new, state.codes_sent = codes[state.codes_sent :], len(codes)
        return new
