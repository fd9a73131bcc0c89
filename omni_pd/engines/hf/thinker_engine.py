"""The thinker as continuously batched engines: colocated, prefill leg, decode leg.

Each step the scheduler admits waiting requests (oldest first) while the step's budget allows
(`max_num_seqs` requests held, `max_num_batched_tokens` tokens computed: a prefill costs its
prompt, a decode one token) and the paged cache has blocks for their prompt plus `max_tokens`.
Admitted requests start (colocated: prefill; decode leg: fetch the KV over Mooncake), then every
request that was already running decodes one token in one batched, batch-invariant pass. The
prefill leg only prefills: it publishes each prompt's KV for its decode engine and is done.

A request's state lives in one `ThinkerRequest`, held in `_requests` from `add_request` until it
finishes, fails or is aborted; its blocks go back to the cache on each of those paths.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ...kv import BlockLayout, KVDescriptor, KVReceiver, KVSender, MooncakeTransport
from ...sampling import SamplingParams
from ..base import BatchStats, StageEngine, StepOutput
from ..sampler import sample_next_token
from ..types import ThinkerChunk, ThinkerOutput, ThinkerPrompt
from . import batch_invariant as bi
from .paged_cache import PagedKVCache
from .thinker import ThinkerRunner
from .thinker_batch import BatchedThinkerDecoder, DecodeRow

log = logging.getLogger(__name__)

_TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cache_to_canonical(cache: DynamicCache) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] from a batch-of-one DynamicCache."""
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def thinker_layout(thinker, block_size: int) -> BlockLayout:
    text = thinker.config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = _TORCH_TO_NAME[next(thinker.parameters()).dtype]
    return BlockLayout.default_for(text.num_hidden_layers, text.num_key_value_heads, head_dim,
                                   dtype, block_size=block_size)


def _kv_settings(stage_config) -> tuple[str, str]:
    kv = stage_config.kv_transfer_config
    extra = kv.kv_connector_extra_config if kv else None
    protocol = (extra.mooncake_protocol if extra and extra.mooncake_protocol else "tcp")
    host = (kv.kv_ip if kv and kv.kv_ip else "127.0.0.1")
    return host, protocol


@dataclass
class ThinkerRequest:
    request_id: str
    prompt: ThinkerPrompt
    params: SamplingParams
    stream: bool
    arrived: float = field(default_factory=time.perf_counter)
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    streamed: int = 0  # tokens already sent as deltas
    chunks: bool = False  # send ThinkerChunks (a talker runs alongside), not only token deltas
    rows_streamed: int = 0  # output rows already sent in chunks
    chunks_sent: int = 0
    rope_deltas: int = 0
    prompt_embeds: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    output_embeds: list[torch.Tensor] = field(default_factory=list)
    output_hidden: list[torch.Tensor] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.prompt_token_ids)

    @property
    def position(self) -> int:
        """Where the latest token goes: prompt plus the tokens already fed back."""
        return self.prompt_len + len(self.tokens) - 1

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1e3


class _ThinkerEngine(StageEngine):
    """Scheduling, request bookkeeping and batched decoding shared by the three thinker roles."""

    control_calls = StageEngine.control_calls | {"set_batch_invariant"}
    decodes = True  # the prefill leg overrides: it never decodes
    prefill_costs_tokens = True  # the decode leg's prompts arrive as KV: admitting computes none

    def __init__(self, stage_config, runner: ThinkerRunner):
        self.stage_id = stage_config.stage_id
        self.runner = runner
        args = stage_config.engine_args
        self.max_num_seqs = stage_config.max_num_seqs
        self.max_num_batched_tokens = stage_config.max_num_batched_tokens
        self.block_size = args.kv_block_size
        self._requests: dict[str, ThinkerRequest] = {}
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        self._stats = BatchStats()
        self.cache: PagedKVCache | None = None
        if self.decodes:
            text = runner.text_config
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            self.cache = PagedKVCache(text.num_hidden_layers, text.num_key_value_heads, head_dim,
                                      self.block_size, args.kv_pool_blocks,
                                      next(runner.thinker.parameters()).dtype)
            self.decoder = BatchedThinkerDecoder(runner.thinker, runner.accept_hidden_layer)
        log.info("stage %d: thinker engine, max_num_seqs %d, max_num_batched_tokens %d%s",
                 self.stage_id, self.max_num_seqs, self.max_num_batched_tokens,
                 f", {args.kv_pool_blocks} KV blocks of {self.block_size} tokens" if self.cache else "")

    # ---- the request lifecycle ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams,
                    stream: bool = False, chunks: bool = False) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in stage {self.stage_id}")
        request = ThinkerRequest(request_id, prompt, params, stream or chunks, chunks=chunks)
        if request.prompt_len == 0:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        if self.prefill_costs_tokens and request.prompt_len > self.max_num_batched_tokens:
            raise ValueError(f"request {request_id}: the prompt has {request.prompt_len} tokens, over "
                             f"stage {self.stage_id}'s max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}); raise it in engine_args or shorten "
                             "the prompt")
        if self.cache is not None:
            needed = self.cache.blocks_for(request.prompt_len + params.max_tokens)
            if needed > self.cache.num_blocks:
                raise ValueError(f"request {request_id}: prompt plus max_tokens need {needed} KV "
                                 f"blocks, stage {self.stage_id} has {self.cache.num_blocks}; raise "
                                 "engine_args.kv_pool_blocks or lower max_tokens")
        self._check(request)
        self._requests[request_id] = request
        self._waiting.append(request_id)

    def _check(self, request: ThinkerRequest) -> None:
        """Role-specific validation (kv_transfer_params)."""

    def abort_request(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._drop(request)
            log.debug("stage %d: request %s aborted", self.stage_id, request_id)

    def _drop(self, request: ThinkerRequest) -> None:
        del self._requests[request.request_id]
        if request.request_id in self._running:
            self._running.remove(request.request_id)
        else:
            try:
                self._waiting.remove(request.request_id)
            except ValueError:
                pass
        if request.blocks:
            self.cache.release(request.blocks)
            request.blocks = []

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def debug_state_counts(self) -> dict[str, int]:
        counts = {"thinker.requests": len(self._requests)}
        if self.cache is not None:
            counts["thinker.kv_blocks_in_use"] = self.cache.num_used
        return counts

    # ---- one step ----------------------------------------------------------------------------
    def batch_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self._stats)

    @staticmethod
    def set_batch_invariant(enabled: bool) -> None:
        """Test hook: plain (batch-dependent) linear layers in this worker when False."""
        bi.set_enabled(enabled)

    def step(self) -> list[StepOutput]:
        decoding = [self._requests[r] for r in self._running]
        outputs: list[StepOutput] = []
        admitted = self._admit(len(decoding))
        self._stats.record(len(admitted), len(decoding))
        for request in admitted:
            try:
                outputs.extend(self._start(request))
            except Exception as exc:
                log.debug("stage %d: request %s failed to start", self.stage_id, request.request_id,
                          exc_info=True)
                self._drop(request)
                outputs.append(StepOutput.failed(request.request_id, f"{type(exc).__name__}: {exc}"))
        if decoding:
            outputs.extend(self._decode(decoding))
        return outputs

    def _admit(self, num_decoding: int) -> list[ThinkerRequest]:
        budget = self.max_num_batched_tokens - num_decoding
        slots = self.max_num_seqs - num_decoding
        admitted: list[ThinkerRequest] = []
        while self._waiting and len(admitted) < slots:
            request = self._requests[self._waiting[0]]
            cost = request.prompt_len if self.prefill_costs_tokens else 1
            if cost > budget:
                break  # oldest first: a long prompt is not overtaken
            if self.cache is not None:
                if self.cache.blocks_for(request.prompt_len + request.params.max_tokens) > self.cache.num_free:
                    break
                request.blocks = self.cache.allocate(request.prompt_len + request.params.max_tokens)
            self._waiting.popleft()
            budget -= cost
            admitted.append(request)
        return admitted

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        raise NotImplementedError

    def _first_token(self, request: ThinkerRequest, token: int) -> list[StepOutput]:
        """A request has its first token: it runs (decodes from the next step) or is done."""
        request.tokens.append(token)
        request.metrics["first_token_ms"] = request.elapsed_ms()
        reason = self.runner.finish_reason(request.tokens, request.params)
        if reason is not None:
            return [self._finish(request, reason)]
        self._running.append(request.request_id)
        return [self._delta(request)] if request.stream else []

    def _decode(self, batch: list[ThinkerRequest]) -> list[StepOutput]:
        rows = [DecodeRow(r.tokens[-1], r.position, r.rope_deltas, r.blocks) for r in batch]
        result = self.decoder.step(rows, self.cache)
        outputs = []
        for b, request in enumerate(batch):
            request.output_embeds.append(result.embeds[b].clone())
            request.output_hidden.append(result.hidden[b].clone())
            token = sample_next_token(result.logits[b], request.params, step=len(request.tokens),
                                      seen_token_ids=request.prompt.prompt_token_ids + request.tokens)
            request.tokens.append(token)
            reason = self.runner.finish_reason(request.tokens, request.params)
            if reason is not None:
                outputs.append(self._finish(request, reason))
            elif request.stream:
                outputs.append(self._delta(request))
        return outputs

    def _delta(self, request: ThinkerRequest, finished: bool = False, output: Any = None) -> StepOutput:
        """A streamed request's new tokens (for the client's text) and a chunk with them and the
        rows of the tokens fed back since the last one (for a talker that runs alongside)."""
        if not request.stream:
            return StepOutput(request.request_id, finished=finished, output=output)
        new = request.tokens[request.streamed:]
        request.streamed = len(request.tokens)
        if not request.chunks:
            return StepOutput(request.request_id, new_token_ids=new, finished=finished, output=output)
        rows = request.output_embeds[request.rows_streamed:]
        width = self.runner.text_config.hidden_size
        first = request.chunks_sent == 0
        chunk = ThinkerChunk(
            token_ids=list(new),
            embeds=torch.stack(rows) if rows else torch.zeros((0, width)),
            start=request.prompt_len + request.rows_streamed,
            prompt_token_ids=list(request.prompt.prompt_token_ids) if first else None,
            prompt_embeds=request.prompt_embeds if first else None,
            prompt_hidden=request.prompt_hidden if first else None)
        request.rows_streamed = len(request.output_embeds)
        request.chunks_sent += 1
        return StepOutput(request.request_id, new_token_ids=new, chunk=chunk, finished=finished,
                          output=output)

    def _finish(self, request: ThinkerRequest, reason: str) -> StepOutput:
        width = self.runner.text_config.hidden_size
        embeds = torch.stack(request.output_embeds) if request.output_embeds else torch.zeros((0, width))
        hidden = torch.stack(request.output_hidden) if request.output_hidden else torch.zeros((0, width))
        request.metrics["e2e_ms"] = request.elapsed_ms()
        output = self._output(request, reason, embeds, hidden)
        self._drop(request)
        return self._delta(request, finished=True, output=output)

    def _output(self, request: ThinkerRequest, reason: str, embeds: torch.Tensor,
                hidden: torch.Tensor) -> ThinkerOutput:
        return ThinkerOutput(
            request_id=request.request_id, prompt_token_ids=list(request.prompt.prompt_token_ids),
            token_ids=list(request.tokens), text=self.runner.detokenize(request.tokens, request.params),
            finish_reason=reason, prompt_embeds=request.prompt_embeds,
            prompt_hidden=request.prompt_hidden, output_embeds=embeds, output_hidden=hidden,
            output_start=request.prompt_len, metrics=dict(request.metrics))


class HfThinkerEngine(_ThinkerEngine):
    """The whole thinker in one engine: prefill, then batched decode, in the same process."""

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        pre = self.runner.prefill(request.prompt, request.params)
        self.cache.write(request.blocks, 0, cache_to_canonical(pre.cache))
        request.rope_deltas = pre.rope_deltas
        request.prompt_embeds, request.prompt_hidden = pre.prompt_embeds, pre.prompt_hidden
        request.metrics["prefill_ms"] = pre.prefill_ms
        return self._first_token(request, pre.first_token)


class HfPrefillEngine(_ThinkerEngine):
    """The prefill leg: prefills each admitted prompt and publishes its KV for the decode leg
    (leased blocks in a pool registered with Mooncake), answering with the first token."""

    decodes = False
    control_calls = _ThinkerEngine.control_calls | {"release_kv", "inject_kv_fault"}

    def __init__(self, stage_config, runner: ThinkerRunner):
        super().__init__(stage_config, runner)
        args = stage_config.engine_args
        kv = stage_config.kv_transfer_config
        self.engine_id = (kv.engine_id if kv and kv.engine_id else f"prefill-{uuid.uuid4().hex[:12]}")
        host, protocol = _kv_settings(stage_config)
        self.transport = MooncakeTransport(host=host, protocol=protocol)
        self.layout = thinker_layout(runner.thinker, self.block_size)
        self.sender = KVSender(self.engine_id, self.layout, args.kv_pool_blocks, self.transport,
                               args.kv_lease_timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "kv_session": self.transport.session_id,
                "kv_layout": self.layout.to_dict()}

    def _check(self, request: ThinkerRequest) -> None:
        kv_params = request.params.kv_transfer_params or {}
        if not kv_params.get("do_remote_decode") or not kv_params.get("transfer_id"):
            raise ValueError(f"request {request.request_id}: a prefill-only stage needs "
                             "kv_transfer_params with do_remote_decode=true and a transfer_id (the "
                             "orchestrator's P/D planning sets them)")

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        transfer_id = request.params.kv_transfer_params["transfer_id"]
        pre = self.runner.prefill(request.prompt, request.params)
        descriptor = self.sender.publish(transfer_id, cache_to_canonical(pre.cache))
        out_params = {
            **descriptor.to_params(),
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_bootstrap_addr": f"mooncake://{self.transport.session_id}",
            "remote_request_id": request.request_id,
            "first_token": pre.first_token,
            "rope_deltas": pre.rope_deltas,
        }
        log.debug("request %s: published %d prompt tokens as transfer %s", request.request_id,
                  request.prompt_len, transfer_id)
        output = ThinkerOutput(
            request_id=request.request_id, prompt_token_ids=list(request.prompt.prompt_token_ids),
            token_ids=[pre.first_token], text="", finish_reason="length",
            prompt_embeds=pre.prompt_embeds, prompt_hidden=pre.prompt_hidden,
            output_start=request.prompt_len, kv_transfer_params=out_params,
            metrics={"first_token_ms": request.elapsed_ms(), "prefill_ms": pre.prefill_ms})
        self._drop(request)
        return [StepOutput(request.request_id, finished=True, output=output)]

    def release_kv(self, transfer_id: str) -> bool:
        return self.sender.release(transfer_id)

    def inject_kv_fault(self, block_index: int = 0, byte_offset: int = 3) -> None:
        self.sender.inject_fault_once(block_index, byte_offset)

    def housekeeping(self) -> None:
        self.sender.expire_leases()

    def debug_state_counts(self) -> dict[str, int]:
        return {**super().debug_state_counts(), **self.sender.debug_state_counts()}

    def close(self) -> None:
        self.sender.close()


class HfDecodeEngine(_ThinkerEngine):
    """The decode leg: admitting a request fetches its prompt's KV from the prefill engine into
    the request's own blocks; then it decodes with everything else that runs."""

    prefill_costs_tokens = False

    def __init__(self, stage_config, runner: ThinkerRunner):
        super().__init__(stage_config, runner)
        host, protocol = _kv_settings(stage_config)
        self.transport = MooncakeTransport(host=host, protocol=protocol)
        self.layout = thinker_layout(runner.thinker, self.block_size)
        self.receiver = KVReceiver(self.layout, stage_config.engine_args.kv_pool_blocks, self.transport)

    def describe(self) -> dict[str, Any]:
        return {"kv_session": self.transport.session_id, "kv_layout": self.layout.to_dict()}

    def _check(self, request: ThinkerRequest) -> None:
        kv_params = request.params.kv_transfer_params or {}
        if not kv_params.get("do_remote_prefill"):
            raise ValueError(f"request {request.request_id}: a decode-only stage needs "
                             "kv_transfer_params with do_remote_prefill=true from a prefill stage")
        descriptor = KVDescriptor.from_params(kv_params)
        if descriptor.num_tokens != request.prompt_len:
            raise ValueError(f"request {request.request_id}: transfer {descriptor.transfer_id} holds "
                             f"KV for {descriptor.num_tokens} tokens but the prompt has "
                             f"{request.prompt_len}")

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        kv_params = request.params.kv_transfer_params
        fetched = self.receiver.fetch(KVDescriptor.from_params(kv_params))
        self.cache.write(request.blocks, 0, fetched.kv)
        request.rope_deltas = int(kv_params["rope_deltas"])
        request.metrics.update(kv_transfer_ms=fetched.transfer_ms,
                               kv_bytes_transferred=fetched.bytes_transferred)
        return self._first_token(request, int(kv_params["first_token"]))

    def _output(self, request: ThinkerRequest, reason: str, embeds: torch.Tensor,
                hidden: torch.Tensor) -> ThinkerOutput:
        output = super()._output(request, reason, embeds, hidden)
        output.prompt_embeds = output.prompt_hidden = None  # they stay with the prefill leg
        output.num_cached_prompt_tokens = request.prompt_len
        return output

    def debug_state_counts(self) -> dict[str, int]:
        return {**super().debug_state_counts(), **self.receiver.debug_state_counts()}

    def close(self) -> None:
        self.receiver.close()
