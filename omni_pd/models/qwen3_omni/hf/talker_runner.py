"""The talker and its code predictor as the generic engines run them: an `ArRunner`
(engines/core/runner.py) on the engine's paged KV cache.

Many requests per step, each request's codes bit-identical whether it runs alone or among any
others:

* every linear layer and the MoE go through `batch_invariant` (fixed row tiles, experts summed in
  a fixed order), so a row's result never depends on how many rows share the matrix;
* attention is the engine's (engines/core/attention.py), per sequence over exactly that
  sequence's positions: a decode step's in one C kernel call per layer that computes each
  sequence alone (the default), or with torch's attention per sequence (`kernels="torch"`);
  never one padded batch;
* the prompts admitted in one step are prefilled in one pass on the same tiles, attention per
  prompt (torch's fused causal attention, `prompt_attention = "fused"`: a talker prompt is never
  cached), so a prompt's prefill is the same bits alone or with others;
* sampling draws one uniform number per row, `step_uniform(seed, step * num_code_groups + group)`
  (a hash of the request's seed and position), so a draw depends on the request's seed and
  position only, never on the batch or on the global RNG.

The engine holds the request (its blocks, its code0s as `tokens`); what the talker adds per
request lives in one `TalkerState` (its inputs, its frames, its latest hidden state): dropping
the request frees it.

Semantics follow `Qwen3OmniMoeTalkerForConditionalGeneration.generate` (transformers 5.19):
the step that samples code0 at position t feeds, at t + 1, the sum of the frame's code embeddings
(the talker's codec embedding of code0 plus the code predictor's per-group embeddings of codes
1..G-1) plus `trailing_text_hidden[t]` (or `tts_pad_embed` past its end). The code predictor
starts from [the talker's final-norm hidden state at t, embedding of code0]. codec_eos ends a
request; the EOS code0, or a code0 cut off by max_tokens, gets no frame (transformers computes a
frame's residual codes only when it feeds that frame back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from omni_pd.engines.core.attention import StepAttention
from omni_pd.engines.core.fallback import each_alone
from omni_pd.engines.core.request import EngineRequest
from omni_pd.engines.core.runner import ArRunnerBase, DecodeResult, Prefilled, PrefillItem, RunnerIdentity
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.attention_native import native_builds
from omni_pd.engines.hf.compute import HfCompute
from omni_pd.kv import BlockLayout
from omni_pd.kv.fingerprint import weights_digest
from omni_pd.models.codec_sampling import RowSampling, process_code0_scores, sample_rows
from omni_pd.models.qwen3_omni.records import TalkerInputDelta, TalkerOutput, TalkerPrompt
from omni_pd.sampling import SamplingParams
from .talker_model import TalkerModel

# What transformers' talker passes to the code predictor's generate when sampling.
CODE_PREDICTOR_TOP_K = 50
CODE_PREDICTOR_TOP_P = 0.8
_TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class TalkerState:
    """What the talker keeps per request, beside the engine's record (whose `tokens` are the
    sampled code0s, EOS included)."""

    prompt_embeds: torch.Tensor  # [prompt_len, hidden]: the talker's prefill input
    trailing: torch.Tensor  # [T, hidden]: trailing_text_hidden, one row per decode step
    tts_pad: torch.Tensor  # [hidden]
    frames: list[list[int]] = field(default_factory=list)  # [code0, code1, ..., code_{G-1}]
    hidden: torch.Tensor | None = None  # [hidden]: final-norm hidden of the latest position
    error: str | None = None  # its own sampling failed (the others go on)
    frames_sent: int = 0
    # A talker fed while its thinker runs: the thinker output so far (None once complete),
    # whether `trailing` has every row (else a decode step waits for its row to arrive), and
    # whether output arrived since the last step (None: no; else whether it was the last).
    thinker_so_far: Any = None
    trailing_complete: bool = True
    stale: bool | None = None
    trace: dict[str, list] | None = None  # raw logits, when the runner traces (tests)

    @property
    def ready_to_decode(self) -> bool:
        """Its next step's trailing row is known (or the trailing text is complete)."""
        return self.trailing_complete or len(self.frames) < self.trailing.shape[0]

    def codes(self, num_code_groups: int) -> torch.Tensor:
        """[num_code_groups, frames], int64."""
        if not self.frames:
            return torch.zeros((num_code_groups, 0), dtype=torch.long)
        return torch.tensor(self.frames, dtype=torch.long).transpose(0, 1).contiguous()


class TalkerRunner(ArRunnerBase):
    """The talker and its code predictor, run for many requests per step."""

    name = "talker"
    # A talker prompt is never cached: torch's fused attention over the prompt alone.
    prompt_attention = "fused"
    emits_text = False  # its tokens are codec codes: they leave in chunks, not as text

    def __init__(
        self, talker: torch.nn.Module, runner: TalkerModel, trace: bool = False, kernels: str = "native"
    ):
        self.talker = talker
        self.runner = runner  # builds each request's inputs (thinker rows projected)
        talker_config = runner.config.talker_config
        self.model = talker.model  # Qwen3OmniMoeTalkerModel
        self.predictor = talker.code_predictor
        bi.check_activations(talker)
        self.config = talker_config
        text = talker_config.text_config
        self.num_code_groups = talker_config.num_code_groups
        self.codec_eos = talker_config.codec_eos_token_id
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.kv_heads = text.num_key_value_heads
        cp_config = talker_config.code_predictor_config
        self.cp_head_dim = (
            getattr(cp_config, "head_dim", None) or cp_config.hidden_size // cp_config.num_attention_heads
        )
        self.cp_kv_heads = cp_config.num_key_value_heads
        if getattr(text, "sliding_window", None) or getattr(cp_config, "sliding_window", None):
            raise NotImplementedError("the batched talker has no sliding-window attention")
        self.suppress_mask = torch.zeros(text.vocab_size, dtype=torch.bool)
        if runner.suppressed:
            self.suppress_mask[torch.tensor(runner.suppressed, dtype=torch.long)] = True
        # The code predictor samples with its own generation config's temperature (top_k / top_p
        # are passed explicitly by transformers' talker).
        temperature = getattr(self.predictor.generation_config, "temperature", None)
        self.cp_temperature = 1.0 if temperature is None else float(temperature)
        self.trace = trace
        self.compute = HfCompute(kernels)
        self.kernels = self.compute.name
        self.row_dtype = next(talker.parameters()).dtype

    @property
    def device(self) -> str:
        return str(next(self.talker.parameters()).device)

    def kv_layout(self, block_size: int) -> BlockLayout:
        text = self.config.text_config
        return BlockLayout.default_for(
            text.num_hidden_layers,
            self.kv_heads,
            self.head_dim,
            _TORCH_TO_NAME[self.row_dtype],
            block_size=block_size,
        )

    def identity(self) -> RunnerIdentity:
        return RunnerIdentity(
            f"{self.config.model_type} talker",
            weights_digest(self.talker.named_parameters()),
            self.device,
            native_builds(self.kernels),
        )

    def describe(self) -> dict[str, Any]:
        return {"engine": "hf-talker-batched", "attention_kernels": self.kernels}

    # -- requests -------------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt: TalkerPrompt, params: SamplingParams) -> EngineRequest:
        """A request from the thinker's output (`prompt.final`), or from its first part while
        it runs (later tokens arrive through `append_input`)."""
        self.runner.speaker_id(prompt.speaker)  # ValueError naming the voices
        try:
            if prompt.final:
                inputs = self.runner.build_inputs(prompt)
            else:  # the thinker still runs: its later tokens arrive through append_input
                inputs = self.runner.prefill_inputs(prompt)
                inputs["trailing_text_hidden"] = self.runner.trailing_rows(prompt, 0, final=False).unsqueeze(
                    0
                )
        except ValueError:
            raise
        except Exception as exc:  # a malformed prompt this engine can never run
            raise ValueError(f"request {request_id}: cannot build the talker input: {exc}") from exc
        state = TalkerState(
            prompt_embeds=inputs["inputs_embeds"][0].detach().contiguous(),
            trailing=inputs["trailing_text_hidden"][0].detach().contiguous(),
            tts_pad=inputs["tts_pad_embed"].reshape(-1).detach().contiguous(),
        )
        if not prompt.final:
            state.thinker_so_far, state.trailing_complete = prompt, False
        if self.trace:
            state.trace = {"code0_logits": [], "cp_logits": [], "hidden": []}
        return EngineRequest(
            request_id, prompt, params, prompt_len=state.prompt_embeds.shape[0], token_ids=None, model=state
        )

    def append_input(self, request: EngineRequest, data: TalkerInputDelta, final: bool) -> None:
        """More thinker output for a talker started while its thinker runs: the trailing text
        grows by the rows that output now determines (all of them when `final`), projected at
        the next step with every other request's new rows in one pass."""
        state = request.model
        prompt = state.thinker_so_far
        if prompt is None:
            raise ValueError(f"request {request.request_id}: thinker output arrived after the last of it")
        if data.thinker_embeds.shape[0]:
            prompt.thinker_embeds = torch.cat([prompt.thinker_embeds, data.thinker_embeds])
        prompt.output_token_ids = prompt.output_token_ids + list(data.output_token_ids)
        state.stale = final

    def pending(self, requests: Sequence[EngineRequest]) -> bool:
        return any(r.model.stale is not None for r in requests)

    def restart(self, request: EngineRequest) -> None:
        """Its inputs (prompt, trailing rows, thinker output so far) stay; its frames go
        (frames_sent: what was sent)."""
        state = request.model
        state.frames, state.hidden, state.error = [], None, None
        if state.trace is not None:
            state.trace = {name: [] for name in state.trace}

    def ready(self, request: EngineRequest) -> bool:
        return request.model.ready_to_decode

    def before_step(self, requests: Sequence[EngineRequest]) -> list[tuple[EngineRequest, str]]:
        """The trailing rows the thinker output appended since the last step, for every request
        at once (one append per request per thinker token: projecting them one by one was a
        tenth of the talker's time at 16 requests); a request whose rows cannot be built fails
        alone."""
        stale = [r for r in requests if r.model.stale is not None]
        failed: list[tuple[EngineRequest, str]] = []

        def rows_of(batch: Sequence[EngineRequest]) -> list[torch.Tensor]:
            return self.runner.trailing_rows_many(
                [(r.model.thinker_so_far, r.model.trailing.shape[0], r.model.stale) for r in batch]
            )

        def fail(request: EngineRequest, exc: Exception) -> None:
            request.model.stale = None
            failed.append((request, f"talker input: {type(exc).__name__}: {exc}"))

        for request, rows in each_alone(stale, rows_of, fail, "talker input rows"):
            state, final = request.model, request.model.stale
            state.stale = None
            if rows.shape[0]:
                state.trailing = torch.cat([state.trailing, rows])
            if final:
                state.thinker_so_far, state.trailing_complete = None, True
        return failed

    # -- steps ----------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, items: Sequence[PrefillItem], attention: StepAttention) -> list[Prefilled]:
        """The prompts in one pass: their KV and first code0 logits. Linear layers and the MoE
        run on the fixed tiles, attention per prompt, so a prompt's results are the same bits in
        a pass of its own or with others."""
        requests = [item.request for item in items]
        counts = [r.prompt_len for r in requests]
        x = torch.cat([r.model.prompt_embeds for r in requests])
        positions = torch.cat([torch.arange(c) for c in counts])
        hidden = self._talker_forward(x, positions, attention)
        last = hidden[torch.tensor(counts).cumsum(0) - 1]
        logits = bi.linear_module(self.talker.codec_head, last)
        for request, row in zip(requests, last):
            request.model.hidden = row.clone()
        return [Prefilled(logits[i]) for i in range(len(requests))]  # KV: the engine's, from `attention`

    @torch.no_grad()
    def decode(self, requests: Sequence[EngineRequest], attention: StepAttention) -> DecodeResult:
        """One step for every request: the code predictor fills the pending frame's residual
        codes, the frame is fed back, and the talker gives the next code0's logits. A request
        whose own sampling failed gets no forward pass (its `error` says why)."""
        states = [r.model for r in requests]
        residuals, frame_embeds = self._predict_residuals(requests)
        vocab = self.talker.codec_head.weight.shape[0]
        logits = torch.zeros((len(requests), vocab), dtype=frame_embeds.dtype)
        alive = [i for i, state in enumerate(states) if state.error is None]
        if not alive:
            return DecodeResult(logits)
        # The text row each fed-back frame gets: trailing_text_hidden at the frame's index, or
        # tts_pad past its end.
        text_rows = [
            s.trailing[len(s.frames)] if len(s.frames) < s.trailing.shape[0] else s.tts_pad for s in states
        ]
        for i in alive:
            states[i].frames.append([requests[i].tokens[-1]] + residuals[i])
        inputs = frame_embeds + torch.stack(text_rows)  # elementwise: per row
        if len(alive) < len(states):
            inputs = inputs[alive]
        live = [requests[i] for i in alive]
        positions = torch.tensor([r.position for r in live])
        step = attention if len(alive) == len(states) else attention.select(alive)
        hidden = self._talker_forward(inputs, positions, step)
        logits[alive] = bi.linear_module(self.talker.codec_head, hidden)
        for row, request in enumerate(live):
            request.model.hidden = hidden[row]  # a view: each step's hidden is a fresh tensor
        return DecodeResult(logits)

    # -- sampling -------------------------------------------------------------------------------

    def sample(
        self, requests: Sequence[EngineRequest], logits: torch.Tensor, first: bool
    ) -> list[int | Exception]:
        """The next code0 of every request (row i of `logits` is request i's)."""
        states = [r.model for r in requests]
        for state, row in zip(states, logits):
            if state.trace is not None and state.error is None:
                state.trace["code0_logits"].append(row.detach().clone())
                state.trace["hidden"].append(state.hidden.detach().clone())
        # ignore_eos: an EOS code0 has no frame to decode, so rather than go on past it (vLLM's
        # meaning for text), the talker never samples it and runs to max_tokens.
        scores = process_code0_scores(
            logits,
            [r.tokens for r in requests],
            [r.params.repetition_penalty for r in requests],
            self.suppress_mask,
            [r.params.ignore_eos for r in requests],
            self.codec_eos,
        )
        specs = [
            RowSampling(
                r.params.greedy,
                r.params.temperature,
                max(r.params.top_k, 0),
                r.params.top_p,
                _seed(r),
                len(r.tokens) * self.num_code_groups,
            )
            for r in requests
        ]
        picks = self._sample(requests, scores, specs, "talker sampling")
        return [pick if pick is not None else RuntimeError(s.error) for pick, s in zip(picks, states)]

    def finish_reason(self, request: EngineRequest) -> str | None:
        if request.tokens[-1] == self.codec_eos:
            return "stop"
        if len(request.tokens) >= request.params.max_tokens:
            return "length"
        return None

    def _take_residuals(
        self, requests: Sequence[EngineRequest], group: int, logits: torch.Tensor
    ) -> list[int]:
        # transformers mirrors the talker's do_sample onto the code predictor.
        specs = [
            RowSampling(
                r.params.greedy,
                self.cp_temperature,
                CODE_PREDICTOR_TOP_K,
                CODE_PREDICTOR_TOP_P,
                _seed(r),
                (len(r.tokens) - 1) * self.num_code_groups + group,
            )
            for r in requests
        ]
        picks = self._sample(requests, logits.float(), specs, f"code predictor sampling (group {group})")
        return [0 if pick is None else pick for pick in picks]

    @staticmethod
    def _sample(
        requests: Sequence[EngineRequest], scores: torch.Tensor, specs: list[RowSampling], what: str
    ) -> list[int | None]:
        """All rows at once; if that raises (a NaN row, say), row by row, so that only the
        requests whose rows fail are failed (their pick is None, their state's `error` set)."""
        picks: list[int | None] = [None] * len(requests)
        live = [i for i, r in enumerate(requests) if r.model.error is None]

        def draw(rows: Sequence[int]) -> list[int]:
            return sample_rows(scores[list(rows)], [specs[i] for i in rows])

        def fail(i: int, exc: Exception) -> None:
            requests[i].model.error = f"{what} failed at step {len(requests[i].tokens)}: {exc}"

        for i, pick in each_alone(live, draw, fail, what):
            picks[i] = pick
        return picks

    # -- results --------------------------------------------------------------------------------

    def output(self, request: EngineRequest, reason: str) -> TalkerOutput:
        elapsed = (time.perf_counter() - request.admitted_at) * 1e3
        return TalkerOutput(
            request_id=request.request_id,
            codes=request.model.codes(self.num_code_groups),
            metrics={"talker_ms": elapsed},
        )

    def chunk(self, request: EngineRequest, new_tokens: list[int], first: bool, finished: bool) -> Any:
        """The frames to send now: none until a whole chunk is there (or the request is done).
        One message per downstream chunk instead of one per frame: the orchestrator handled 63
        messages per request that only its stream processor's buffer saw."""
        state = request.model
        if request.chunk_sizes is not None and not finished:
            first, later = request.chunk_sizes
            due = first if state.frames_sent == 0 else later
            if len(state.frames) - state.frames_sent < due:
                return None
        if len(state.frames) == state.frames_sent:
            return None
        new = state.frames[state.frames_sent :]  # plain lists: a fraction of a tensor to send
        state.frames_sent = len(state.frames)
        return new

    # -- the talker -----------------------------------------------------------------------------

    def _talker_forward(
        self, x: torch.Tensor, positions: torch.Tensor, attention: StepAttention
    ) -> torch.Tensor:
        """The step's new rows of `x` ([rows, hidden]), in sequence order, at `positions`;
        returns the final-norm hidden states ([rows, hidden]: what transformers'
        `hidden_states[0][-1]` holds and what the codec head reads). Their KV is the engine's:
        `attention` writes a decode step's into the blocks and keeps a prefill's."""
        # Text-only talker input: the three multimodal rotary rows are all the plain position.
        rope_positions = positions.view(1, 1, -1).expand(3, 1, -1)
        cos, sin = self.model.rotary_emb(x.unsqueeze(0), rope_positions)  # [1, rows, hd]
        for index, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = bi.projections(attn, bi.norm(layer.input_layernorm, x), self.head_dim, cos, sin)
            out = attention(index, *(t[0].transpose(0, 1) for t in (q, k, v)), attn.scaling)
            x = x + bi.linear_module(attn.o_proj, out)
            x = x + bi.mlp(layer.mlp, bi.norm(layer.post_attention_layernorm, x), self.kernels)
        return bi.norm(self.model.norm, x)

    # -- the code predictor ---------------------------------------------------------------------

    def _predict_residuals(self, requests: Sequence[EngineRequest]) -> tuple[list[list[int]], torch.Tensor]:
        """Codes 1..G-1 of every state's pending frame, batched: every request has the same
        predictor length at a given group. Returns the codes and the frames' summed code
        embeddings ([B, hidden]: the talker's codec embedding of code0 plus the predictor's
        embedding of each later group, added in group order, elementwise, as transformers sums
        the G concatenated embeddings)."""
        states = [r.model for r in requests]
        batch, groups = len(states), self.num_code_groups
        cp = self.predictor.model
        code0 = torch.tensor([r.tokens[-1] for r in requests], dtype=torch.long)
        first = self.model.codec_embedding(code0)  # [B, hidden]
        total = first
        codes: list[list[int]] = [[] for _ in range(batch)]
        hidden = torch.stack([s.hidden for s in states])  # [B, hidden]
        # Prefill [past_hidden, code0 embedding] (2 rows per request), then one row per group.
        x = torch.stack([hidden, first], dim=1).reshape(2 * batch, -1)
        caches = [
            (
                torch.zeros((batch, self.cp_kv_heads, groups, self.cp_head_dim), dtype=x.dtype),
                torch.zeros((batch, self.cp_kv_heads, groups, self.cp_head_dim), dtype=x.dtype),
            )
            for _ in cp.layers
        ]
        length = 0
        for group in range(1, groups):
            width = 2 if group == 1 else 1
            out = self._predictor_forward(x, batch, width, length, caches)
            length += width
            last = out.view(batch, width, -1)[:, -1]
            logits = bi.linear_module(self.predictor.lm_head[group - 1], last)  # [B, cp_vocab]
            for b, state in enumerate(states):
                if state.trace is not None:
                    if group == 1:
                        state.trace["cp_logits"].append([])
                    state.trace["cp_logits"][-1].append(logits[b].detach().clone())
            picks = self._take_residuals(requests, group, logits)
            x = cp.codec_embedding[group - 1](torch.tensor(picks, dtype=torch.long))  # [B, hidden]
            total = total + x
            for b in range(batch):
                codes[b].append(picks[b])
        return codes, total

    def _predictor_forward(
        self,
        x: torch.Tensor,
        batch: int,
        width: int,
        start: int,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        cp = self.predictor.model
        positions = torch.arange(start, start + width).repeat(batch).unsqueeze(0)  # [1, rows]
        cos, sin = cp.rotary_emb(x.unsqueeze(0), positions)
        for layer, (keys, values) in zip(cp.layers, caches):
            attn = layer.self_attn
            q, k, v = bi.projections(attn, bi.norm(layer.input_layernorm, x), self.cp_head_dim, cos, sin)
            # Every request has the same predictor length here, so one attention call serves
            # the batch: scaled_dot_product_attention computes each batch entry on its own
            # (tests/test_talker_batch.py holds batched == solo to the bit).
            if width > 1 and start:
                raise NotImplementedError("several new predictor rows after cached ones")
            keys[:, :, start : start + width] = _per_request(k, batch, width)
            values[:, :, start : start + width] = _per_request(v, batch, width)
            out = F.scaled_dot_product_attention(
                _per_request(q, batch, width).contiguous(),
                keys[:, :, : start + width],
                values[:, :, : start + width],
                is_causal=width > 1,
                scale=attn.scaling,
                enable_gqa=keys.shape[1] != q.shape[1],
            )  # [B, heads, width, hd]
            x = x + bi.linear_module(attn.o_proj, out.transpose(1, 2).reshape(batch * width, -1))
            x = x + bi.mlp(layer.mlp, bi.norm(layer.post_attention_layernorm, x), self.kernels)
        return bi.norm(cp.norm, x)


def _per_request(t: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[1, heads, batch * width, hd] (rows request-major) -> [batch, heads, width, hd]."""
    return t[0].unflatten(1, (batch, width)).transpose(0, 1)


def _seed(request: EngineRequest) -> int:
    return request.params.seed if request.params.seed is not None else 0
