"""The talker's continuously batched, batch-invariant core.

`TalkerRunner.generate` runs transformers' `generate` for one sequence at a time. This module
computes the same model (the talker's MoE decoder, its codec head, and the code predictor that
fills in the residual code groups of every frame) for many requests per step, such that a request's
codes are bit-identical whether it runs alone or among any others:

* every linear layer and the MoE go through `batch_invariant` (fixed row tiles, experts summed in
  a fixed order), so a row's result never depends on how many rows share the matrix;
* attention is computed per sequence, over exactly that sequence's cached positions: a decode
  step's in one C kernel call per layer that computes each sequence alone
  (`attention_native`, the default), or with torch's `scaled_dot_product_attention` per
  sequence (`kernels="torch"`); never one padded batch;
* the prompts admitted in one step are prefilled in one pass on the same tiles, attention per
  prompt, so a prompt's prefill is the same bits alone or with others;
* sampling draws one uniform number per row, `step_uniform(seed, step * num_code_groups + group)`
  (a hash of the request's seed and position), so a draw depends on the request's seed and
  position only, never on the batch or on the global RNG.

Everything one request owns lives in one `TalkerRequestState` (its talker inputs, its KV cache,
its codes, its step index): dropping the object frees the request.

Semantics follow `Qwen3OmniMoeTalkerForConditionalGeneration.generate` (transformers 5.19):
the step that samples code0 at position t feeds, at t + 1, the sum of the frame's code embeddings
(the talker's codec embedding of code0 plus the code predictor's per-group embeddings of codes
1..G-1) plus `trailing_text_hidden[t]` (or `tts_pad_embed` past its end). The code predictor
starts from [the talker's final-norm hidden state at t, embedding of code0]. codec_eos ends a
request; the EOS code0, or a code0 cut off by max_tokens, gets no frame (transformers computes a
frame's residual codes only when it feeds that frame back).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from omni_pd.sampling import SamplingParams
from omni_pd.engines.sampler import step_uniform
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.attention_native import CacheGeometry, DecodeRows, check_kernels, decode_attention

# What transformers' talker passes to the code predictor's generate when sampling.
CODE_PREDICTOR_TOP_K = 50
CODE_PREDICTOR_TOP_P = 0.8
# The KV cache grows in chunks of at least this many positions (then doubles).
_MIN_CACHE_GROWTH = 64


@dataclass
class TalkerRequestState:
    """One request's whole state in the batched talker."""

    request_id: str
    params: SamplingParams
    prompt_embeds: torch.Tensor  # [prompt_len, hidden]: the talker's prefill input
    trailing: torch.Tensor  # [T, hidden]: trailing_text_hidden, one row per decode step
    tts_pad: torch.Tensor  # [hidden]
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [capacity, kv_heads, hd]
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0  # positions cached
    code0s: list[int] = field(default_factory=list)  # every sampled code0, EOS included
    frames: list[list[int]] = field(default_factory=list)  # [code0, code1, ..., code_{G-1}]
    hidden: torch.Tensor | None = None  # [hidden]: final-norm hidden of the latest position
    finished: bool = False
    finish_reason: str | None = None  # "stop" (codec EOS) | "length"
    error: str | None = None
    admitted_at: float | None = None
    stream: bool = False  # send new frames as they come (streaming to code2wav)
    frames_sent: int = 0
    chunk_sizes: tuple[int, int] | None = None  # frames per chunk sent, first and later
    # A talker fed while its thinker runs: the thinker output so far (None once complete), and
    # whether `trailing` has every row (else a decode step waits for its row to arrive).
    thinker_so_far: Any = None
    trailing_complete: bool = True
    trace: dict[str, list] | None = None  # raw logits, when the core traces (tests)

    @property
    def prompt_len(self) -> int:
        return self.prompt_embeds.shape[0]

    @property
    def step(self) -> int:
        """The talker step index: how many code0s have been sampled."""
        return len(self.code0s)

    @property
    def seed(self) -> int:
        return self.params.seed if self.params.seed is not None else 0

    def codes(self, num_code_groups: int) -> torch.Tensor:
        """[num_code_groups, frames], int64."""
        if not self.frames:
            return torch.zeros((num_code_groups, 0), dtype=torch.long)
        return torch.tensor(self.frames, dtype=torch.long).transpose(0, 1).contiguous()

    def forget_prefill(self) -> None:
        """Back to before its prefill, so that it can run again (after a failed batched pass):
        its cached rows are rewritten, its first pick taken again."""
        self.length, self.hidden, self.code0s = 0, None, []
        self.finished, self.finish_reason, self.error = False, None, None

    @property
    def ready_to_decode(self) -> bool:
        """Its next step's trailing row is known (or the trailing text is complete)."""
        return self.trailing_complete or len(self.frames) < self.trailing.shape[0]

    def take_new_frames(self) -> list[list[int]] | None:
        """Frames made since the last call, for a streamed request (None when there are none):
        plain lists, which cost a fraction of a tensor to send."""
        if len(self.frames) == self.frames_sent:
            return None
        new = self.frames[self.frames_sent:]
        self.frames_sent = len(self.frames)
        return new


def process_code0_scores(logits: torch.Tensor, generated: list[list[int]], penalties: list[float],
                         suppress_mask: torch.Tensor, no_eos: list[bool], eos: int) -> torch.Tensor:
    """transformers' logits processors for the talker, for a batch of rows ([B, vocab]): the
    repetition penalty of each row over its generated ids (the prompt is embeddings only, so
    only they count), then suppress_tokens, and the codec EOS for the rows in `no_eos`.
    Elementwise per (row, id), so a row's scores do not depend on the others; one gather and
    one scatter for the whole batch."""
    scores = logits.float()
    rows: list[int] = []
    ids: list[int] = []
    factors: list[float] = []
    for row, (seen, penalty) in enumerate(zip(generated, penalties)):
        if penalty != 1.0 and seen:
            rows.extend([row] * len(seen))
            ids.extend(seen)
            factors.extend([penalty] * len(seen))
    if rows:
        where = (torch.tensor(rows), torch.tensor(ids))
        penalty = torch.tensor(factors, dtype=scores.dtype)
        picked = scores[where]
        scores = scores.index_put(where, torch.where(picked < 0, picked * penalty, picked / penalty))
    scores = scores.masked_fill(suppress_mask, float("-inf"))
    if any(no_eos):
        scores[torch.tensor(no_eos), eos] = float("-inf")
    return scores


@dataclass(frozen=True)
class RowSampling:
    """How one row of a batch is sampled: greedy, or transformers' warpers (temperature, top-k,
    top-p, in that order) and a draw keyed by the request's seed and `key`."""

    greedy: bool
    temperature: float
    top_k: int  # 0: off
    top_p: float
    seed: int
    key: int


def sample_rows(scores: torch.Tensor, rows: list[RowSampling]) -> list[int]:
    """One pick per row of `scores` ([B, vocab]). Greedy rows take the argmax. Sampled rows are
    warped and drawn on their top-k candidates only (the whole vocabulary where top-k is off):
    temperature, then top-k, then top-p (a candidate stays while the mass of the better ones is
    below top_p, at least one), then an inverse-CDF draw with the row's uniform number. Rows are
    grouped by candidate count and every op works along a row (top-k, softmax, cumsum, search),
    so a row's pick is the same in a batch of one or of many."""
    picks = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        for i, pick in zip(greedy, torch.argmax(scores[greedy], dim=-1).tolist()):
            picks[i] = pick
    vocab = scores.shape[1]
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.greedy:
            groups.setdefault(min(r.top_k, vocab) if r.top_k > 0 else vocab, []).append(i)
    for width, members in groups.items():
        for i, pick in zip(members, _draw(scores[members], [rows[i] for i in members], width)):
            picks[i] = pick
    return picks


def _draw(scores: torch.Tensor, specs: list[RowSampling], width: int) -> list[int]:
    """Draws for rows that all keep `width` candidates."""
    temperatures = [r.temperature for r in specs]
    if any(t != 1.0 for t in temperatures):
        scores = scores / torch.tensor(temperatures, dtype=scores.dtype).unsqueeze(1)
    values, candidates = torch.topk(scores, width, dim=-1)  # best first
    probs = torch.softmax(values, dim=-1)
    if any(r.top_p < 1.0 for r in specs):
        before = probs.cumsum(dim=-1) - probs
        drop = before >= torch.tensor([r.top_p for r in specs], dtype=probs.dtype).unsqueeze(1)
        drop[:, 0] = False
        probs = torch.softmax(values.masked_fill(drop, float("-inf")), dim=-1)
    # One uniform number per row, a hash of the request's seed and the draw's key, then one
    # row-wise search for all rows (a multinomial call per row was a fifth of a talker step; a
    # torch generator per row, a tenth).
    uniform = torch.tensor([step_uniform(r.seed, r.key) for r in specs], dtype=probs.dtype)
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True)
    # The candidates with mass are a prefix (best first, the dropped ones last); past it only
    # when rounding makes the draw equal the total: then the last candidate with mass.
    chosen = torch.minimum(chosen, (probs > 0).sum(dim=-1, keepdim=True) - 1)
    return candidates.gather(1, chosen).squeeze(1).tolist()


class BatchedTalker:
    """The talker and its code predictor, run for many requests per step."""

    def __init__(self, talker: torch.nn.Module, talker_config, suppressed: list[int],
                 trace: bool = False, kernels: str = "native"):
        self.talker = talker
        self.model = talker.model  # Qwen3OmniMoeTalkerModel
        bi.check_activations(talker)
        self.predictor = talker.code_predictor
        self.config = talker_config
        text = talker_config.text_config
        self.num_code_groups = talker_config.num_code_groups
        self.codec_eos = talker_config.codec_eos_token_id
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.kv_heads = text.num_key_value_heads
        cp_config = talker_config.code_predictor_config
        self.cp_head_dim = (getattr(cp_config, "head_dim", None)
                            or cp_config.hidden_size // cp_config.num_attention_heads)
        self.cp_kv_heads = cp_config.num_key_value_heads
        if getattr(text, "sliding_window", None) or getattr(cp_config, "sliding_window", None):
            raise NotImplementedError("the batched talker has no sliding-window attention")
        self.suppress_mask = torch.zeros(text.vocab_size, dtype=torch.bool)
        if suppressed:
            self.suppress_mask[torch.tensor(suppressed, dtype=torch.long)] = True
        # The code predictor samples with its own generation config's temperature (top_k / top_p
        # are passed explicitly by transformers' talker).
        temperature = getattr(self.predictor.generation_config, "temperature", None)
        self.cp_temperature = 1.0 if temperature is None else float(temperature)
        self.trace = trace
        self.kernels = check_kernels(kernels)
        # Each request's cache is one "block" as long as the cache, token-major.
        self._geometry = CacheGeometry(block=1 << 40, block_stride=0,
                                       pos_stride=self.kv_heads * self.head_dim, head_stride=self.head_dim)

    # -- request state --------------------------------------------------------------------------

    def new_state(self, request_id: str, inputs: dict[str, torch.Tensor],
                  params: SamplingParams) -> TalkerRequestState:
        """A request's state from `TalkerRunner.build_inputs`' output (batch of one)."""
        state = TalkerRequestState(
            request_id=request_id, params=params,
            prompt_embeds=inputs["inputs_embeds"][0].detach().contiguous(),
            trailing=inputs["trailing_text_hidden"][0].detach().contiguous(),
            tts_pad=inputs["tts_pad_embed"].reshape(-1).detach().contiguous())
        if self.trace:
            state.trace = {"code0_logits": [], "cp_logits": [], "hidden": []}
        return state

    def _reserve(self, state: TalkerRequestState, needed: int) -> None:
        """Make room for `needed` positions in the request's own KV cache."""
        capacity = state.keys[0].shape[0] if state.keys else 0
        if needed <= capacity:
            return
        limit = state.prompt_len + state.params.max_tokens
        new_capacity = min(max(needed, 2 * capacity, state.prompt_len + _MIN_CACHE_GROWTH), limit)
        new_capacity = max(new_capacity, needed)
        dtype = state.prompt_embeds.dtype
        for layer in range(len(self.model.layers)):
            for cache in (state.keys, state.values):
                grown = torch.zeros((new_capacity, self.kv_heads, self.head_dim), dtype=dtype)
                if layer < len(cache):
                    grown[:state.length] = cache[layer][:state.length]
                    cache[layer] = grown
                else:
                    cache.append(grown)

    # -- steps ----------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, states: list[TalkerRequestState]) -> None:
        """The requests' prompts in one pass: fills their KV caches and samples their first
        code0s. Linear layers and the MoE run on the fixed tiles, attention per prompt, so a
        prompt's results are the same bits in a pass of its own or with others (requests that
        arrive together cost one pass: at 8, ~1 ms each one by one)."""
        for state in states:
            if state.length:
                raise RuntimeError(f"request {state.request_id} is already prefilled")
        counts = [state.prompt_len for state in states]
        hidden = self._talker_forward(torch.cat([s.prompt_embeds for s in states]), states, counts)
        last = hidden[torch.tensor(counts).cumsum(0) - 1]
        for state, row in zip(states, last):
            state.hidden = row.clone()
        self._take_code0s(states, bi.linear_module(self.talker.codec_head, last))

    @torch.no_grad()
    def decode(self, states: list[TalkerRequestState]) -> None:
        """One step for every state (all prefilled, none finished): the code predictor fills the
        pending frame's residual codes, the frame is fed back, and the talker samples the next
        code0. A failure confined to one request sets that state's `error`."""
        if not states:
            return
        for state in states:
            if state.finished or state.hidden is None:
                raise RuntimeError(f"request {state.request_id} cannot decode "
                                   f"(finished={state.finished}, prefilled={state.hidden is not None})")
        residuals, frame_embeds = self._predict_residuals(states)
        # The text row each fed-back frame gets: trailing_text_hidden at the frame's index, or
        # tts_pad past its end.
        text_rows = [s.trailing[len(s.frames)] if len(s.frames) < s.trailing.shape[0] else s.tts_pad
                     for s in states]
        alive = [i for i, state in enumerate(states) if state.error is None]
        if not alive:
            return
        for i in alive:
            states[i].frames.append([states[i].code0s[-1]] + residuals[i])
        inputs = frame_embeds + torch.stack(text_rows)  # elementwise: per row
        if len(alive) < len(states):
            inputs = inputs[alive]
        live = [states[i] for i in alive]
        hidden = self._talker_forward(inputs, live, [1] * len(live))
        logits = bi.linear_module(self.talker.codec_head, hidden)
        for row, state in enumerate(live):
            state.hidden = hidden[row]  # a view: each step's hidden is a fresh tensor
        self._take_code0s(live, logits)

    # -- sampling -------------------------------------------------------------------------------

    def _take_code0s(self, states: list[TalkerRequestState], logits: torch.Tensor) -> None:
        """Sample the next code0 of every state (row i of `logits` is state i's)."""
        for state, row in zip(states, logits):
            if state.trace is not None:
                state.trace["code0_logits"].append(row.detach().clone())
                state.trace["hidden"].append(state.hidden.detach().clone())
        # ignore_eos: an EOS code0 has no frame to decode, so rather than go on past it (vLLM's
        # meaning for text), the talker never samples it and runs to max_tokens.
        scores = process_code0_scores(logits, [s.code0s for s in states],
                                      [s.params.repetition_penalty for s in states], self.suppress_mask,
                                      [s.params.ignore_eos for s in states], self.codec_eos)
        specs = [RowSampling(s.params.greedy, s.params.temperature, max(s.params.top_k, 0),
                             s.params.top_p, s.seed, s.step * self.num_code_groups) for s in states]
        for state, code0 in zip(states, self._sample(states, scores, specs, "talker sampling")):
            if code0 is None:
                continue
            state.code0s.append(code0)
            if code0 == self.codec_eos:
                state.finished, state.finish_reason = True, "stop"
            elif len(state.code0s) >= state.params.max_tokens:
                state.finished, state.finish_reason = True, "length"

    def _take_residuals(self, states: list[TalkerRequestState], group: int,
                        logits: torch.Tensor) -> list[int]:
        # transformers mirrors the talker's do_sample onto the code predictor.
        specs = [RowSampling(s.params.greedy, self.cp_temperature, CODE_PREDICTOR_TOP_K,
                             CODE_PREDICTOR_TOP_P, s.seed, (s.step - 1) * self.num_code_groups + group)
                 for s in states]
        picks = self._sample(states, logits.float(), specs, f"code predictor sampling (group {group})")
        return [0 if pick is None else pick for pick in picks]

    def _sample(self, states: list[TalkerRequestState], scores: torch.Tensor,
                specs: list[RowSampling], what: str) -> list[int | None]:
        """All rows at once; if that raises (a NaN row, say), row by row, so that only the
        requests whose rows fail are failed (their pick is None)."""
        live = [i for i, s in enumerate(states) if s.error is None]
        picks: list[int | None] = [None] * len(states)
        try:
            for i, pick in zip(live, sample_rows(scores[live], [specs[i] for i in live])):
                picks[i] = pick
            return picks
        except Exception:  # noqa: BLE001 - find the failing rows below
            pass
        for i in live:
            try:
                picks[i] = sample_rows(scores[i:i + 1], [specs[i]])[0]
            except Exception as exc:  # noqa: BLE001 - confined to this request
                self._fail(states[i], f"{what} failed at step {states[i].step}: {exc}")
        return picks

    @staticmethod
    def _fail(state: TalkerRequestState, error: str) -> None:
        state.error = error
        state.finished, state.finish_reason = True, "error"

    # -- the talker -----------------------------------------------------------------------------

    def _talker_forward(self, x: torch.Tensor, states: list[TalkerRequestState],
                        counts: list[int]) -> torch.Tensor:
        """`counts[i]` new rows of `x` ([rows, hidden]) per state, in order; returns the final-norm
        hidden states ([rows, hidden]: what transformers' `hidden_states[0][-1]` holds and what the
        codec head reads)."""
        positions = torch.cat([torch.arange(s.length, s.length + c) for s, c in zip(states, counts)])
        for state, count in zip(states, counts):
            self._reserve(state, state.length + count)
        # Text-only talker input: the three multimodal rotary rows are all the plain position.
        rope_positions = positions.view(1, 1, -1).expand(3, 1, -1)
        cos, sin = self.model.rotary_emb(x.unsqueeze(0), rope_positions)  # [1, rows, hd]
        rows = None
        if self.kernels == "native" and all(count == 1 for count in counts):
            rows = DecodeRows([[0]] * len(states), [s.length + 1 for s in states])
        for index, layer in enumerate(self.model.layers):
            x = x + self._talker_attention(layer.self_attn, layer.input_layernorm(x), cos, sin,
                                           states, counts, index, rows)
            x = x + bi.mlp(layer.mlp, layer.post_attention_layernorm(x))
        for state, count in zip(states, counts):
            state.length += count
        return self.model.norm(x)

    def _talker_attention(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          states: list[TalkerRequestState], counts: list[int], layer: int,
                          rows: DecodeRows | None) -> torch.Tensor:
        q, k, v = bi.projections(attn, x, self.head_dim, cos, sin)  # [1, heads, rows, hd]
        if rows is not None:  # a decode step on the kernel: one new row per sequence
            k_bases = torch.tensor([s.keys[layer].data_ptr() for s in states], dtype=torch.long)
            v_bases = torch.tensor([s.values[layer].data_ptr() for s in states], dtype=torch.long)
            out = decode_attention(_row_major(q), _row_major(k), _row_major(v), rows, k_bases,
                                   v_bases, self._geometry, attn.scaling)
            return bi.linear_module(attn.o_proj, out.reshape(out.shape[0], -1))
        outputs, start = [], 0
        for state, count in zip(states, counts):
            begin, end = state.length, state.length + count
            keys, values = state.keys[layer], state.values[layer]
            keys[begin:end] = k[0, :, start:start + count].transpose(0, 1)
            values[begin:end] = v[0, :, start:start + count].transpose(0, 1)
            outputs.append(bi.attend(q[:, :, start:start + count], _head_major(keys[:end]),
                                   _head_major(values[:end]), attn.scaling, begin))
            start += count
        return bi.linear_module(attn.o_proj, torch.cat(outputs))

    # -- the code predictor ---------------------------------------------------------------------

    def _predict_residuals(self, states: list[TalkerRequestState]
                           ) -> tuple[list[list[int]], torch.Tensor]:
        """Codes 1..G-1 of every state's pending frame, batched: every request has the same
        predictor length at a given group. Returns the codes and the frames' summed code
        embeddings ([B, hidden]: the talker's codec embedding of code0 plus the predictor's
        embedding of each later group, added in group order, elementwise, as transformers sums
        the G concatenated embeddings)."""
        batch, groups = len(states), self.num_code_groups
        cp = self.predictor.model
        code0 = torch.tensor([s.code0s[-1] for s in states], dtype=torch.long)
        first = self.model.codec_embedding(code0)  # [B, hidden]
        total = first
        codes: list[list[int]] = [[] for _ in range(batch)]
        hidden = torch.stack([s.hidden for s in states])  # [B, hidden]
        # Prefill [past_hidden, code0 embedding] (2 rows per request), then one row per group.
        x = torch.stack([hidden, first], dim=1).reshape(2 * batch, -1)
        caches = [(torch.zeros((batch, self.cp_kv_heads, groups, self.cp_head_dim), dtype=x.dtype),
                   torch.zeros((batch, self.cp_kv_heads, groups, self.cp_head_dim), dtype=x.dtype))
                  for _ in cp.layers]
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
            picks = self._take_residuals(states, group, logits)
            x = cp.codec_embedding[group - 1](torch.tensor(picks, dtype=torch.long))  # [B, hidden]
            total = total + x
            for b in range(batch):
                codes[b].append(picks[b])
        return codes, total

    def _predictor_forward(self, x: torch.Tensor, batch: int, width: int, start: int,
                           caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        cp = self.predictor.model
        positions = torch.arange(start, start + width).repeat(batch).unsqueeze(0)  # [1, rows]
        cos, sin = cp.rotary_emb(x.unsqueeze(0), positions)
        for layer, (keys, values) in zip(cp.layers, caches):
            attn = layer.self_attn
            q, k, v = bi.projections(attn, layer.input_layernorm(x), self.cp_head_dim, cos, sin)
            # Every request has the same predictor length here, so one attention call serves
            # the batch: scaled_dot_product_attention computes each batch entry on its own
            # (tests/test_talker_batch.py holds batched == solo to the bit).
            if width > 1 and start:
                raise NotImplementedError("several new predictor rows after cached ones")
            keys[:, :, start:start + width] = _per_request(k, batch, width)
            values[:, :, start:start + width] = _per_request(v, batch, width)
            out = F.scaled_dot_product_attention(
                _per_request(q, batch, width).contiguous(), keys[:, :, :start + width],
                values[:, :, :start + width], is_causal=width > 1, scale=attn.scaling,
                enable_gqa=keys.shape[1] != q.shape[1])  # [B, heads, width, hd]
            x = x + bi.linear_module(attn.o_proj, out.transpose(1, 2).reshape(batch * width, -1))
            x = x + bi.mlp(layer.mlp, layer.post_attention_layernorm(x))
        return cp.norm(x)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """[1, heads, rows, hd] -> contiguous [rows, heads, hd]."""
    return t[0].transpose(0, 1).contiguous()


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """A cache prefix [positions, kv_heads, hd] as attention reads it: [1, kv_heads, positions, hd]."""
    return cache.transpose(0, 1).unsqueeze(0)


def _per_request(t: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[1, heads, batch * width, hd] (rows request-major) -> [batch, heads, width, hd]."""
    return t[0].unflatten(1, (batch, width)).transpose(0, 1)
