"""The talker stage as a continuously batched step engine.

Requests are added and aborted at any time; each `step()` admits waiting requests (up to
`max_num_seqs` running, within a token budget of `max_num_batched_tokens`: one per running
decode plus each admitted prompt's length), prefills each admitted prompt on its own, then advances
every running request by one frame in one batched pass (`talker_batch.BatchedTalker`).

A request's codes do not depend on what else runs: the batched pass uses batch-invariant
(fixed-tile) linears and MoE, attention per sequence, and per-request RNG keyed by (seed, step,
code group), so the engine returns for each request what it would return running it alone.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from omni_pd.sampling import SamplingParams
from omni_pd.engines.base import BatchStats, StageEngine, StepOutput
from omni_pd.models.qwen3_omni.records import TalkerInputDelta, TalkerOutput, TalkerPrompt
from omni_pd.engines.hf import batch_invariant as bi
from ..stage_parts import StageParts
from .talker import TalkerRunner
from .talker_batch import BatchedTalker, TalkerRequestState

log = logging.getLogger(__name__)


class HfTalkerEngine(StageEngine):
    """The talker (thinker embeddings in, codec codes out) for many requests at once."""

    control_calls = StageEngine.control_calls | {"set_batch_invariant"}

    def __init__(self, stage_id: int, model, max_num_seqs: int, max_num_batched_tokens: int,
                 attention_kernels: str = "native"):
        if int(max_num_seqs) < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if int(max_num_batched_tokens) < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.stage_id = stage_id
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        parts = StageParts.of(model)  # a whole model, or a talker stage's parts
        talker = parts.require("talker")
        self.runner = TalkerRunner(talker, parts.require("thinker_embedding"), parts.config)
        self.core = BatchedTalker(talker, parts.config.talker_config, self.runner.suppressed,
                                  kernels=attention_kernels)
        self.num_code_groups = parts.config.talker_config.num_code_groups
        self.waiting: OrderedDict[str, TalkerRequestState] = OrderedDict()
        self.running: OrderedDict[str, TalkerRequestState] = OrderedDict()
        # request id -> whether that was its thinker's last output: rows due at the next step
        self._stale: dict[str, bool] = {}
        self._stats = BatchStats()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: TalkerPrompt, params: SamplingParams,
                    stream: bool = False, chunks: bool = False,
                    chunk_sizes: tuple[int, int] | None = None) -> None:
        """Validate and queue. With `stream`, new codec frames leave as chunks (for a code2wav fed
        while the talker runs): `chunk_sizes` (first, later) frames at a time, the rest with the
        last step; every step's frames when None. The final output has them all."""
        if request_id in self.waiting or request_id in self.running:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r} is already queued")
        if chunk_sizes is not None and (len(chunk_sizes) != 2 or min(chunk_sizes) < 1):
            raise ValueError(f"request {request_id}: chunk_sizes must be two frame counts >= 1 "
                             f"(first chunk, later chunks), got {chunk_sizes!r}")
        self.runner.speaker_id(prompt.speaker)  # ValueError naming the voices
        try:
            if prompt.final:
                inputs = self.runner.build_inputs(prompt)
            else:  # the thinker still runs: its later tokens arrive through append_input
                inputs = self.runner.prefill_inputs(prompt)
                inputs["trailing_text_hidden"] = self.runner.trailing_rows(prompt, 0, final=False).unsqueeze(0)
        except ValueError:
            raise
        except Exception as exc:  # a malformed prompt this engine can never run
            raise ValueError(f"request {request_id}: cannot build the talker input: {exc}") from exc
        length = inputs["inputs_embeds"].shape[1]
        if length > self.max_num_batched_tokens:
            raise ValueError(
                f"request {request_id}: the talker prompt has {length} positions, more than this "
                f"stage's max_num_batched_tokens ({self.max_num_batched_tokens}); raise "
                f"max_num_batched_tokens or shorten the conversation")
        state = self.core.new_state(request_id, inputs, params)
        state.stream = bool(stream or chunks)
        state.chunk_sizes = tuple(chunk_sizes) if chunk_sizes is not None else None
        if not prompt.final:
            state.thinker_so_far, state.trailing_complete = prompt, False
        self.waiting[request_id] = state

    def append_input(self, request_id: str, data: TalkerInputDelta, final: bool) -> None:
        """More thinker output for a talker started while its thinker runs: extends the
        trailing text by the rows that output now determines (all of them when `final`)."""
        state = self.waiting.get(request_id) or self.running.get(request_id)
        if state is None:
            raise ValueError(f"stage {self.stage_id} holds no request {request_id}")
        prompt = state.thinker_so_far
        if prompt is None:
            raise ValueError(f"request {request_id}: thinker output arrived after the last of it")
        if data.thinker_embeds.shape[0]:
            prompt.thinker_embeds = torch.cat([prompt.thinker_embeds, data.thinker_embeds])
        prompt.output_token_ids = prompt.output_token_ids + list(data.output_token_ids)
        # The rows are projected at the next step, with every other request's new rows in one
        # pass (one append per request per thinker token: at 16 requests, a tenth of the
        # talker's time went to projecting them one by one).
        self._stale[request_id] = final

    def _extend_trailing(self) -> list[StepOutput]:
        """The trailing rows the thinker output appended since the last step, for every
        request at once; a request whose rows cannot be built fails alone."""
        if not self._stale:
            return []
        stale = [(self.waiting.get(rid) or self.running.get(rid), final)
                 for rid, final in self._stale.items()]
        self._stale.clear()
        stale = [(state, final) for state, final in stale if state is not None]
        wanted = [(state.thinker_so_far, state.trailing.shape[0], final) for state, final in stale]
        try:
            extensions = self.runner.trailing_rows_many(wanted)
        except Exception:  # noqa: BLE001 - find the failing requests one by one
            extensions = []
            for item in wanted:
                try:
                    extensions.append(self.runner.trailing_rows(*item))
                except Exception as exc:  # noqa: BLE001 - confined to this request
                    extensions.append(exc)
        failed = []
        for (state, final), rows in zip(stale, extensions):
            if isinstance(rows, Exception):
                log.debug("talker input for %s failed: %s", state.request_id, rows)
                self.abort_request(state.request_id)
                failed.append(StepOutput.failed(state.request_id, f"talker input: {type(rows).__name__}: {rows}"))
                continue
            if rows.shape[0]:
                state.trailing = torch.cat([state.trailing, rows])
            if final:
                state.thinker_so_far, state.trailing_complete = None, True
        return failed

    def abort_request(self, request_id: str) -> None:
        # The state object holds everything (inputs, KV cache, codes): dropping it frees it.
        self.waiting.pop(request_id, None)
        self.running.pop(request_id, None)
        self._stale.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: a request waiting for its thinker's next token is not
        (thinker output to project is)."""
        return (bool(self.waiting) or bool(self._stale)
                or any(s.ready_to_decode for s in self.running.values()))

    def request_ids(self) -> list[str]:
        return list(self.waiting) + list(self.running)

    def debug_state_counts(self) -> dict[str, int]:
        return {"talker.requests": len(self.waiting) + len(self.running),
                "talker.unprojected_inputs": len(self._stale)}

    def batch_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self._stats)

    @staticmethod
    def set_batch_invariant(enabled: bool) -> None:
        """Test hook: plain (batch-dependent) linear layers in this worker when False."""
        bi.set_enabled(enabled)

    def describe(self) -> dict[str, Any]:
        return {"engine": "hf-talker-batched", "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "attention_kernels": self.core.kernels}

    # -- the step loop --------------------------------------------------------------------------

    def _admit(self) -> list[TalkerRequestState]:
        """First come, first served: stop at the first waiting request that does not fit."""
        budget = self.max_num_batched_tokens - len(self.running)
        admitted: list[TalkerRequestState] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            state = next(iter(self.waiting.values()))
            if state.prompt_len > budget:
                break
            self.waiting.popitem(last=False)
            budget -= state.prompt_len
            admitted.append(state)
        return admitted

    def _chunk(self, state: TalkerRequestState) -> Any:
        """The frames to send now: none until a whole chunk is there (or the request is done).
        One message per code2wav chunk instead of one per frame: the orchestrator handled 63
        messages per request that only its stream processor's buffer saw."""
        if not state.stream:
            return None
        if state.chunk_sizes is not None and not state.finished:
            first, later = state.chunk_sizes
            due = first if state.frames_sent == 0 else later
            if len(state.frames) - state.frames_sent < due:
                return None
        return state.take_new_frames()

    def _prefill(self, admitted: list[TalkerRequestState], outputs: list[StepOutput]
                 ) -> list[TalkerRequestState]:
        """One pass for every admitted prompt; if it fails, each prompt alone (the same bits),
        so only the prompts that fail alone fail. Returns the prefilled states."""
        if not admitted:
            return []
        try:
            self.core.prefill(admitted)
            return admitted
        except Exception:  # noqa: BLE001 - find the failing prompts one by one
            log.debug("talker: prefill of %d prompts failed; each runs alone", len(admitted),
                      exc_info=True)
        prefilled = []
        for state in admitted:
            state.forget_prefill()  # whatever the failed pass got to is redone
            try:
                self.core.prefill([state])
            except Exception as exc:  # noqa: BLE001 - confined to this request
                log.exception("talker prefill failed for %s", state.request_id)
                outputs.append(StepOutput.failed(state.request_id, f"talker prefill failed: {exc}"))
                continue
            prefilled.append(state)
        return prefilled

    def _finish(self, state: TalkerRequestState) -> StepOutput:
        self.running.pop(state.request_id, None)
        self._stale.pop(state.request_id, None)
        if state.error is not None:
            return StepOutput.failed(state.request_id, f"talker: {state.error}")
        elapsed = (time.perf_counter() - state.admitted_at) * 1e3
        output = TalkerOutput(request_id=state.request_id,
                              codes=state.codes(self.num_code_groups),
                              metrics={"talker_ms": elapsed})
        return StepOutput(state.request_id, chunk=self._chunk(state), finished=True, output=output)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = self._extend_trailing()
        # Prefilled in an earlier step, and not waiting for its thinker's next token.
        decoding = [s for s in self.running.values() if s.ready_to_decode]
        admitted = self._admit()
        self._stats.record(len(admitted), len(decoding))
        for state in admitted:
            state.admitted_at = time.perf_counter()
        for state in self._prefill(admitted, outputs):
            self.running[state.request_id] = state
            if state.finished:
                outputs.append(self._finish(state))
        if decoding:
            try:
                self.core.decode(decoding)
            except Exception as exc:  # noqa: BLE001 - the batched pass: fail its requests
                log.exception("talker decode step failed for %d requests", len(decoding))
                for state in decoding:
                    self.running.pop(state.request_id, None)
                    outputs.append(StepOutput.failed(state.request_id,
                                                     f"talker decode step failed: {exc}"))
                return outputs
            for state in decoding:
                if state.finished:
                    outputs.append(self._finish(state))
                elif state.stream and (chunk := self._chunk(state)) is not None:
                    outputs.append(StepOutput(state.request_id, chunk=chunk))
        return outputs
