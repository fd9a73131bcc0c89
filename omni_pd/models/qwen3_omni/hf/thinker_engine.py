"""The thinker as continuously batched engines: colocated, prefill leg, decode leg.

Each step the scheduler admits waiting requests (oldest first) while the step's budget allows
(`max_num_seqs` requests held, `max_num_batched_tokens` tokens computed: a prefill costs its
prompt, a decode one token) and the paged cache has blocks for their prompt plus `max_tokens`.
Admitted requests start (colocated: prefill; decode leg: submit the KV read over Mooncake, or
prefill locally when the request carries no remote KV), then every request that was already
running decodes one token in one batched, batch-invariant pass. The prefill leg only prefills: it
publishes each prompt's KV for its decode engine and is done.

A request's state lives in one `ThinkerRequest`, held in `_requests` from `add_request` until it
finishes, fails or is aborted; its blocks go back to the cache on each of those paths. Its phase
says which queue holds it: WAITING (not admitted), FETCHING (decode leg: its KV read is in
flight; each step polls it without blocking, bounded by the miss window), RUNNING (decoding).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from omni_pd.kv import BlockLayout, KVDescriptor, KVReceiver, KVSender, MooncakeTransport
from omni_pd.config.schema import KVConnectorExtraConfig
from omni_pd.kv.fingerprint import FINGERPRINT_KEY, PeerFingerprints, kv_fingerprint, weights_digest
from omni_pd.sampling import SamplingParams
from omni_pd.engines.base import BatchStats, StageEngine, StepOutput
from omni_pd.engines.sampler import sample_next_token, sample_next_tokens
from omni_pd.models.qwen3_omni.records import ThinkerChunk, ThinkerOutput, ThinkerPrompt
from omni_pd.engines.hf import batch_invariant as bi
from omni_pd.engines.hf.attention_native import native_builds
from omni_pd.engines.hf.compute_identity import compute_identity
from omni_pd.engines.hf.paged_cache import PagedKVCache
from omni_pd.engines.hf.prefix_cache import multimodal_extra_keys
from .thinker import AudioClip, ThinkerRunner
from .thinker_batch import BatchedThinkerDecoder, CachedPrefix, DecodeRow, PrefilledPrompt

log = logging.getLogger(__name__)

_TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# How long a decode worker whose every request waits on a KV read sleeps between polls: far
# below a transfer's milliseconds of latency, far above a poll's microseconds of CPU.
FETCH_POLL_S = 0.002
# A small read lands within a few milliseconds: poll it closely at first, so the poll interval
# does not add to the handoff (the 2 ms interval tripled the tiny model's 40-token handoff).
FETCH_FAST_POLL_S, FETCH_FAST_WINDOW_S = 0.0002, 0.010


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


def _handoff_settings(stage_config) -> KVConnectorExtraConfig:
    kv = stage_config.kv_transfer_config
    return kv.kv_connector_extra_config if kv else KVConnectorExtraConfig()  # the defaults


def _buffer_device(stage_config) -> str | None:
    """vLLM's kv_buffer_device: where Mooncake moves a GPU stage's KV from ("cuda": the GPU
    memory itself; "cpu": a pinned host copy; unset: the GPU where Mooncake can)."""
    kv = stage_config.kv_transfer_config
    return kv.kv_buffer_device if kv else None


def _engine_id(stage_config, role: str) -> str:
    kv = stage_config.kv_transfer_config
    return kv.engine_id if kv and kv.engine_id else f"{role}-{uuid.uuid4().hex[:12]}"


def model_name(thinker: torch.nn.Module) -> str:
    """What the engine knows of its model: the checkpoint path, else (dummy weights) the config's
    model type and the module's class."""
    config = thinker.config
    return config.name_or_path or f"{config.model_type} ({type(thinker).__name__})"


def thinker_fingerprint(thinker: torch.nn.Module, layout: BlockLayout, engine_id: str,
                        kernels: str) -> dict[str, Any]:
    device = next(thinker.parameters()).device
    return kv_fingerprint(model_name(thinker), weights_digest(thinker.named_parameters()), layout,
                          engine_id, compute_identity(device, native_builds(kernels)))


def _log_fingerprint(stage_id: int, role: str, fingerprint: dict[str, Any]) -> None:
    log.info("stage %d: thinker %s engine KV fingerprint %s", stage_id, role,
             json.dumps(fingerprint, sort_keys=True))


class Phase(enum.Enum):
    WAITING = "waiting"  # added, not admitted yet
    FETCHING = "fetching"  # decode leg: admitted, its prompt's KV read is in flight
    RUNNING = "running"  # admitted and starting (prefill), or has its first token and decodes


@dataclass
class Prefilled:
    """A prompt's prefill, however it ran: its KV as the paged cache writes it, and the rest."""

    kv: torch.Tensor  # [layers, 2, kv_heads, prompt_len, head_dim]
    first_token: int
    rope_deltas: int
    prompt_embeds: torch.Tensor
    prompt_hidden: torch.Tensor
    prefill_ms: float


@dataclass
class ThinkerRequest:
    request_id: str
    prompt: ThinkerPrompt
    params: SamplingParams
    stream: bool
    arrived: float = field(default_factory=time.perf_counter)
    phase: Phase = Phase.WAITING
    kv: KVDescriptor | None = None  # decode leg: the remote prompt KV to fetch (None: prefill here)
    blocks: list[int] = field(default_factory=list)
    cached_len: int = 0  # prompt positions whose KV came from the prefix cache (the first blocks)
    cacheable: bool = True  # False: its blocks neither come from nor go to the prefix cache
    reused: list[int] = field(default_factory=list)  # decode leg: cached blocks while the rest moves
    tokens: list[int] = field(default_factory=list)
    streamed: int = 0  # tokens already sent as deltas
    chunks: bool = False  # send ThinkerChunks (a talker runs alongside), not only token deltas
    rows_streamed: int = 0  # output rows already sent in chunks
    chunks_sent: int = 0
    rope_deltas: int = 0
    prompt_embeds: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    prefilled: Prefilled | None = None  # from the step's batched prefill, until its start takes it
    clips: list[AudioClip] = field(default_factory=list)  # the prompt's audio inputs
    extra_keys: list[bytes] = field(default_factory=list)  # per full prompt block (its audio)
    output_embeds: list[torch.Tensor] = field(default_factory=list)
    output_hidden: list[torch.Tensor] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.prompt_token_ids)

    @property
    def prefills_here(self) -> bool:
        return self.kv is None

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
    # Whether a prompt this engine prefills may start from cached blocks (and so needs the
    # talker's rows of cached blocks kept); the decode leg's fallback prefills whole.
    prefills_over_cache = True

    def __init__(self, stage_config, runner: ThinkerRunner):
        self.stage_id = stage_config.stage_id
        self.runner = runner
        args = stage_config.engine_args
        self.max_num_seqs = stage_config.max_num_seqs
        self.max_num_batched_tokens = stage_config.max_num_batched_tokens
        self.block_size = args.kv_block_size
        self._requests: dict[str, ThinkerRequest] = {}
        self._waiting: deque[str] = deque()
        self._fetching: list[str] = []
        self._running: list[str] = []
        self._stats = BatchStats()
        # Every thinker engine keeps its KV in a paged cache: the prefill leg publishes blocks of
        # it, the decode leg reads remote KV into it.
        # Prefix caching: vLLM's key, on unless the file turns it off.
        self.prefix_caching = args.enable_prefix_caching is not False
        self.device = str(next(runner.thinker.parameters()).device)  # the cache lives with the model
        self.cache = PagedKVCache(thinker_layout(runner.thinker, self.block_size), args.kv_pool_blocks,
                                  shared=self.shares_cache(stage_config),
                                  prefix_caching=self.prefix_caching, device=self.device)
        self.layout = self.cache.layout
        # The talker's rows of cached prompt blocks (layer 0, where audio positions hold the
        # encoder's output, and the accept layer): kept beside the blocks, since a prompt
        # prefilled over a cached prefix computes neither again (nor encodes its audio).
        hidden = runner.text_config.hidden_size
        keep = self.prefix_caching and self.prefills_over_cache
        dtype = next(runner.thinker.parameters()).dtype
        self.cached_embeds, self.cached_hidden = (
            (torch.zeros((args.kv_pool_blocks, self.block_size, hidden), dtype=dtype),
             torch.zeros((args.kv_pool_blocks, self.block_size, hidden), dtype=dtype))
            if keep else (None, None))
        self.prefix_hit_tokens = self.prefix_query_tokens = 0
        # Batched passes: decode steps, and the prefill of text-only prompts (every role).
        self.decoder = BatchedThinkerDecoder(runner.thinker, runner.accept_hidden_layer,
                                             args.attention_kernels)
        config = runner.thinker.config
        # Images and video need the 3D rotary, which the batched pass does not compute.
        self._vision_ids = frozenset(getattr(config, name) for name in
                                     ("image_token_id", "video_token_id")
                                     if getattr(config, name, None) is not None)
        log.info("stage %d: thinker engine, max_num_seqs %d, max_num_batched_tokens %d, %d KV blocks "
                 "of %d tokens, prefix caching %s", self.stage_id, self.max_num_seqs,
                 self.max_num_batched_tokens, args.kv_pool_blocks, self.block_size,
                 "on" if self.prefix_caching else "off")

    # ---- the request lifecycle ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: ThinkerPrompt, params: SamplingParams,
                    stream: bool = False, chunks: bool = False,
                    chunk_sizes: tuple[int, int] | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in stage {self.stage_id}")
        request = ThinkerRequest(request_id, prompt, params, stream or chunks, chunks=chunks)
        if request.prompt_len == 0:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        self._check(request)
        # Audio inputs are placed and hashed now: a malformed prompt fails here, alone.
        request.clips = self.runner.audio_clips(prompt)
        request.extra_keys = multimodal_extra_keys([(c.start, c.end, c.key) for c in request.clips],
                                                   request.prompt_len, self.block_size)
        if request.prefills_here and request.prompt_len > self.max_num_batched_tokens:
            raise ValueError(f"request {request_id}: the prompt has {request.prompt_len} tokens, over "
                             f"stage {self.stage_id}'s max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}); raise it in engine_args or shorten "
                             "the prompt")
        needed = self.cache.blocks_for(request.prompt_len + params.max_tokens)
        if needed > self.cache.num_blocks:
            raise ValueError(f"request {request_id}: prompt plus max_tokens need {needed} KV "
                             f"blocks, stage {self.stage_id} has {self.cache.num_blocks}; raise "
                             "engine_args.kv_pool_blocks or lower max_tokens")
        self._requests[request_id] = request
        self._waiting.append(request_id)

    @staticmethod
    def shares_cache(stage_config) -> bool:
        """Whether the paged cache lives in shared memory (the prefill leg's, same-host path)."""
        return False

    def _check(self, request: ThinkerRequest) -> None:
        """Role-specific validation (kv_transfer_params); may set `request.kv`."""

    def abort_request(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._drop(request)
            log.debug("stage %d: request %s aborted", self.stage_id, request_id)

    def _queue(self, phase: Phase) -> deque[str] | list[str]:
        return {Phase.WAITING: self._waiting, Phase.FETCHING: self._fetching,
                Phase.RUNNING: self._running}[phase]

    def _drop(self, request: ThinkerRequest) -> None:
        del self._requests[request.request_id]
        queue = self._queue(request.phase)
        if request.request_id in queue:
            queue.remove(request.request_id)
        self._release(request)
        if request.blocks:
            self.cache.release(request.blocks)
            request.blocks = []

    def _release(self, request: ThinkerRequest) -> None:
        """Role-specific resources of a request that leaves (the decode leg's KV read)."""

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def debug_state_counts(self) -> dict[str, int]:
        return {"thinker.requests": len(self._requests),
                "thinker.kv_blocks_in_use": self.cache.num_used - self._blocks_lent()}

    def load(self) -> dict[str, int]:
        load = {"requests": len(self._requests), "waiting": len(self._waiting),
                "free_kv_blocks": self.cache.num_free, "kv_blocks": self.cache.num_blocks,
                "kv_block_size": self.cache.block_size}
        if self.prefix_caching:  # counters since start: Prometheus derives the hit rate
            load.update(prefix_cache_queries=self.prefix_query_tokens,
                        prefix_cache_hits=self.prefix_hit_tokens,
                        prefix_cached_blocks=self.cache.prefix.num_cached)
        return load

    def _blocks_lent(self) -> int:
        """Cache blocks another owner holds now (the decode leg's KV reads)."""
        return 0

    # ---- one step ----------------------------------------------------------------------------
    def batch_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self._stats)

    @staticmethod
    def set_batch_invariant(enabled: bool) -> None:
        """Test hook: plain (batch-dependent) linear layers in this worker when False."""
        bi.set_enabled(enabled)

    def step(self) -> list[StepOutput]:
        decoding = [self._requests[r] for r in self._running]
        # Requests whose KV arrived get their first token now and decode from the next step,
        # as an admitted prompt does.
        outputs = self._progress()
        admitted = self._admit(len(decoding))
        self._stats.record(len(admitted), len(decoding))
        self._prefill_together([r for r in admitted if r.prefills_here and self._batchable(r)])
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

    def _progress(self) -> list[StepOutput]:
        """Advance requests that wait on I/O (the decode leg's KV reads); none here."""
        return []

    def _can_start(self, request: ThinkerRequest) -> bool:
        """Role-specific resources a request needs to be admitted (beyond cache blocks)."""
        return True

    def _admit(self, num_decoding: int) -> list[ThinkerRequest]:
        budget = self.max_num_batched_tokens - num_decoding
        slots = self.max_num_seqs - (len(self._requests) - len(self._waiting))  # held: admitted
        admitted: list[ThinkerRequest] = []
        while self._waiting and len(admitted) < slots:
            request = self._requests[self._waiting[0]]
            cached = self._match_prefix(request)
            # A remote prompt's KV arrives by transfer: admitting it computes no token.
            cost = request.prompt_len - len(cached) * self.block_size if request.prefills_here else 1
            positions = request.prompt_len + request.params.max_tokens
            if (cost > budget or not self._can_start(request)
                    or self.cache.blocks_for(positions) - len(cached) > self.cache.num_free):
                self.cache.release(cached)  # oldest first: a long prompt is not overtaken
                break
            request.blocks = cached + self.cache.allocate(positions, have=len(cached))
            request.cached_len = len(cached) * self.block_size
            if self.prefix_caching and request.prefills_here and self._batchable(request):
                self.prefix_query_tokens += request.prompt_len
                self.prefix_hit_tokens += request.cached_len
            self._waiting.popleft()
            request.phase = Phase.RUNNING  # until its start says otherwise (fetching)
            budget -= cost
            admitted.append(request)
        return admitted

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        raise NotImplementedError

    def _match_prefix(self, request: ThinkerRequest) -> list[int]:
        """The cached blocks holding the longest prefix of a prompt this engine prefills, held
        for it now; none without prefix caching, and none for prompts with images or video
        (their prefill runs through transformers' own forward, whose rows depend on the prompt's
        length). Blocks with audio match only the same audio (their extra keys). The last prompt
        position is always computed: its logits give the first token."""
        if not (self.prefix_caching and request.prefills_here and self._batchable(request)
                and request.cacheable):
            return []
        return self.cache.prefix.match(request.prompt.prompt_token_ids, request.extra_keys,
                                       limit=request.prompt_len - 1)

    def _prefix(self, request: ThinkerRequest) -> CachedPrefix | None:
        return CachedPrefix(request.cached_len, request.blocks) if request.cached_len else None

    def _cache_prompt(self, request: ThinkerRequest, pre: Prefilled,
                      checksums: list[str] = ()) -> None:
        """Name the prompt's full blocks for later prompts, with their accept-layer rows (and,
        on the prefill leg, the checksums they were published with)."""
        if not (self.prefix_caching and self._batchable(request) and request.cacheable):
            return
        ids = request.prompt.prompt_token_ids
        full = len(ids) // self.block_size
        if self.cached_hidden is not None:
            for index in range(request.cached_len // self.block_size, full):
                span = slice(index * self.block_size, (index + 1) * self.block_size)
                self.cached_embeds[request.blocks[index]] = pre.prompt_embeds[span]
                self.cached_hidden[request.blocks[index]] = pre.prompt_hidden[span]
        self.cache.prefix.register(request.blocks[:full], ids, request.extra_keys, checksums=checksums)

    def _batchable(self, request: ThinkerRequest) -> bool:
        """Text and audio: the batched pass has no 3D rotary for images or video."""
        return self._vision_ids.isdisjoint(request.prompt.prompt_token_ids)

    def _layer0(self, request: ThinkerRequest) -> torch.Tensor | None:
        """Layer 0 of the positions a prompt with audio computes (after its cached prefix), its
        audio encoded here; None for text, whose rows the batched pass looks up itself."""
        if not request.clips:
            return None
        return self.runner.layer0_rows(request.prompt, request.clips, request.cached_len)

    def _prefill_together(self, requests: list[ThinkerRequest]) -> None:
        """One batched pass for the text-only prompts admitted in this step; each request's
        share waits on it until its start. If the pass fails, each prompt runs the same pass
        alone at its start, so only the prompts that fail alone fail."""
        if not requests:
            return
        began = time.perf_counter()
        try:
            results = self.decoder.prefill([r.prompt.prompt_token_ids for r in requests],
                                           [self._prefix(r) for r in requests], self.cache,
                                           [self._layer0(r) for r in requests])
        except Exception:  # noqa: BLE001 - retried per request at its start
            log.debug("stage %d: batched prefill of %d prompts failed; each runs alone", self.stage_id,
                      len(requests), exc_info=True)
            return
        elapsed = (time.perf_counter() - began) * 1e3
        for request, result in zip(requests, results):
            try:
                request.prefilled = self._take_first_token(request, result, elapsed)
            except Exception:  # noqa: BLE001 - its start prefills it again and fails it alone
                log.debug("stage %d: request %s: first token failed", self.stage_id,
                          request.request_id, exc_info=True)

    def _take_first_token(self, request: ThinkerRequest, result: PrefilledPrompt,
                          elapsed_ms: float) -> Prefilled:
        first = sample_next_token(result.logits, request.params, step=0,
                                  seen_token_ids=request.prompt.prompt_token_ids)
        embeds, hidden = result.embeds, result.hidden
        if request.cached_len:
            # The cached positions' rows were kept beside their blocks.
            cached = request.blocks[:request.cached_len // self.block_size]
            embeds = torch.cat([self.cached_embeds[cached].flatten(0, 1), embeds])
            hidden = torch.cat([self.cached_hidden[cached].flatten(0, 1), hidden])
        return Prefilled(result.kv, first, 0, embeds, hidden, elapsed_ms)

    def _prefill(self, request: ThinkerRequest) -> Prefilled:
        """The request's prefill: its share of the step's batched pass, or run now (alone
        through the batched pass, or through transformers' forward with images or video)."""
        pre, request.prefilled = request.prefilled, None
        if pre is not None:
            return pre
        began = time.perf_counter()
        if self._batchable(request):
            [result] = self.decoder.prefill([request.prompt.prompt_token_ids],
                                            [self._prefix(request)], self.cache,
                                            [self._layer0(request)])
            return self._take_first_token(request, result, (time.perf_counter() - began) * 1e3)
        run = self.runner.prefill(request.prompt, request.params)
        return Prefilled(cache_to_canonical(run.cache), run.first_token, run.rope_deltas,
                         run.prompt_embeds, run.prompt_hidden, run.prefill_ms)

    def _prefill_here(self, request: ThinkerRequest) -> list[StepOutput]:
        """Prefill the prompt into the request's blocks and take its first token."""
        pre = self._prefill(request)
        self.cache.write(request.blocks, request.cached_len, pre.kv)
        self._cache_prompt(request, pre)
        request.rope_deltas = pre.rope_deltas
        request.prompt_embeds, request.prompt_hidden = pre.prompt_embeds, pre.prompt_hidden
        request.metrics["prefill_ms"] = pre.prefill_ms
        return self._first_token(request, pre.first_token)

    def _first_token(self, request: ThinkerRequest, token: int) -> list[StepOutput]:
        """A request has its first token: it runs (decodes from the next step) or is done."""
        request.tokens.append(token)
        request.metrics["first_token_ms"] = request.elapsed_ms()
        reason = self.runner.finish_reason(request.tokens, request.params)
        if reason is not None:
            return [self._finish(request, reason)]
        if request.request_id not in self._running:
            self._running.append(request.request_id)
        return [self._delta(request)] if request.stream else []

    def _decode(self, batch: list[ThinkerRequest]) -> list[StepOutput]:
        rows = [DecodeRow(r.tokens[-1], r.position, r.rope_deltas, r.blocks) for r in batch]
        result = self.decoder.step(rows, self.cache)
        tokens = sample_next_tokens(
            result.logits, [r.params for r in batch], [len(r.tokens) for r in batch],
            lambda b: batch[b].prompt.prompt_token_ids + batch[b].tokens)
        outputs = []
        for b, (request, token) in enumerate(zip(batch, tokens)):
            request.output_embeds.append(result.embeds[b].clone())
            request.output_hidden.append(result.hidden[b].clone())
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
            output_start=request.prompt_len,
            metrics={**request.metrics, "prefix_cached_tokens": request.cached_len})


class HfThinkerEngine(_ThinkerEngine):
    """The whole thinker in one engine: prefill, then batched decode, in the same process."""

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        return self._prefill_here(request)


class HfPrefillEngine(_ThinkerEngine):
    """The prefill leg: prefills each admitted prompt and publishes its KV for the decode leg
    (leased blocks in a pool registered with Mooncake), answering with the first token."""

    decodes = False
    control_calls = _ThinkerEngine.control_calls | {"release_kv", "inject_kv_fault"}

    @staticmethod
    def shares_cache(stage_config) -> bool:
        return _handoff_settings(stage_config).kv_same_host != "off"

    def __init__(self, stage_config, runner: ThinkerRunner):
        super().__init__(stage_config, runner)
        args = stage_config.engine_args
        self.engine_id = _engine_id(stage_config, "prefill")
        host, protocol = _kv_settings(stage_config)
        self.transport = MooncakeTransport(host=host, protocol=protocol)
        self.fingerprint = thinker_fingerprint(runner.thinker, self.layout, self.engine_id,
                                               self.decoder.kernels)
        _log_fingerprint(self.stage_id, "prefill", self.fingerprint)
        # The paged cache is what is published: registered once, its blocks leased as they are.
        handoff = _handoff_settings(stage_config)
        self.sender = KVSender(self.engine_id, self.layout, self.cache.pool, self.transport,
                               args.kv_lease_timeout_s, buffer_device=_buffer_device(stage_config),
                               same_host=handoff.kv_same_host != "off")
        self._fault_pending = False  # inject_kv_fault: the next admitted request stays uncached

    def describe(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "kv_session": self.transport.session_id,
                "kv_layout": self.layout.to_dict(), FINGERPRINT_KEY: self.fingerprint}

    def _check(self, request: ThinkerRequest) -> None:
        kv_params = request.params.kv_transfer_params or {}
        if not kv_params.get("do_remote_decode") or not kv_params.get("transfer_id"):
            raise ValueError(f"request {request.request_id}: a prefill-only stage needs "
                             "kv_transfer_params with do_remote_decode=true and a transfer_id (the "
                             "orchestrator's P/D planning sets them)")

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        transfer_id = request.params.kv_transfer_params["transfer_id"]
        pre = self._prefill(request)
        if request.cached_len:
            # Cached blocks go with the checksums they were named with (memory that changed
            # since fails the handoff); the rest are checksummed as they now lie.
            self.cache.write(request.blocks, request.cached_len, pre.kv)
            reused = request.cached_len // self.block_size
            sums = ([self.cache.prefix.checksum(b) for b in request.blocks[:reused]]
                    + self.cache.checksums(request.blocks, request.prompt_len, first=reused))
        else:  # block by block as written (each still in cache): no second pass at publish
            sums = self.cache.write(request.blocks, 0, pre.kv, checksums=True)
        self._cache_prompt(request, pre, sums)
        prompt_blocks = self.cache.blocks_for(request.prompt_len)
        descriptor = self.sender.publish_blocks(transfer_id, request.blocks[:prompt_blocks],
                                                request.prompt_len, checksums=sums)
        request.blocks = request.blocks[prompt_blocks:]  # the lease holds the prompt's blocks now
        out_params = {
            **descriptor.to_params(),
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_bootstrap_addr": f"mooncake://{self.transport.session_id}",
            "remote_request_id": request.request_id,
            "first_token": pre.first_token,
            "rope_deltas": pre.rope_deltas,
            FINGERPRINT_KEY: self.fingerprint,
            # False: the decode side must neither reuse cached blocks for it nor cache these.
            "kv_cacheable": request.cacheable,
        }
        log.debug("request %s: published %d prompt tokens as transfer %s", request.request_id,
                  request.prompt_len, transfer_id)
        output = ThinkerOutput(
            request_id=request.request_id, prompt_token_ids=list(request.prompt.prompt_token_ids),
            token_ids=[pre.first_token], text="", finish_reason="length",
            prompt_embeds=pre.prompt_embeds, prompt_hidden=pre.prompt_hidden,
            output_start=request.prompt_len, kv_transfer_params=out_params,
            metrics={"first_token_ms": request.elapsed_ms(), "prefill_ms": pre.prefill_ms,
                     "prefix_cached_tokens": request.cached_len})
        self._drop(request)
        return [StepOutput(request.request_id, finished=True, output=output)]

    def _match_prefix(self, request: ThinkerRequest) -> list[int]:
        if self._fault_pending:  # the oldest waiting request is the next one published
            request.cacheable, self._fault_pending = False, False
        return super()._match_prefix(request)

    def release_kv(self, transfer_id: str) -> bool:
        return self.sender.release(transfer_id)

    def inject_kv_fault(self, block_index: int = 0, byte_offset: int = 3,
                        after_checksum: bool = False) -> None:
        """Test hook: the next published request gets one flipped byte. Its blocks stay out of
        the prefix cache both ways, so the flip corrupts that request alone, as a fault in
        transit would, and not the cached prefix of the requests after it."""
        self.sender.inject_fault_once(block_index, byte_offset, after_checksum)
        self._fault_pending = True

    def housekeeping(self) -> None:
        self.sender.expire_leases()

    def debug_state_counts(self) -> dict[str, int]:
        return {**super().debug_state_counts(), **self.sender.debug_state_counts()}

    def _blocks_lent(self) -> int:
        return self.sender.blocks_held

    def close(self) -> None:
        self.sender.close()


class HfDecodeEngine(_ThinkerEngine):
    """The decode leg. A request whose kv_transfer_params carry do_remote_prefill has its
    prompt's KV read from the prefill engine: admitting it submits the read, each step polls it
    (other requests decode meanwhile), and once it has arrived and checked out it is written
    into the request's blocks and the request runs. The wait is bounded by `kv_wait_s` from the
    request's kv_transfer_params, else the stage's kv_miss_window_s; past it the request fails
    with KVMissError. A request without remote KV is prefilled here, as the colocated engine
    does (the orchestrator's fallback when the prefill peer is dead, frozen or broken)."""

    prefills_over_cache = False  # its blocks are named without the talker's rows (_match_prefix)

    def __init__(self, stage_config, runner: ThinkerRunner):
        super().__init__(stage_config, runner)
        self._last_fetch_start = 0.0  # when the newest KV read started (perf_counter)
        handoff = _handoff_settings(stage_config)
        self.kv_miss_window_s = handoff.kv_miss_window_s
        self.engine_id = _engine_id(stage_config, "decode")
        host, protocol = _kv_settings(stage_config)
        # A read abandoned on a frozen peer holds its blocks until Mooncake gives up on
        # it: make that the handoff deadline rather than Mooncake's 30 s.
        self.transport = MooncakeTransport(host=host, protocol=protocol,
                                           progress_timeout_s=handoff.kv_handoff_deadline_s)
        self.fingerprint = thinker_fingerprint(runner.thinker, self.layout, self.engine_id,
                                               self.decoder.kernels)
        _log_fingerprint(self.stage_id, "decode", self.fingerprint)
        self.peers = PeerFingerprints(self.fingerprint,
                                      require_identical_kernels=handoff.require_identical_kernels)
        # The KV lands where it is used: the receiver reads into blocks of the paged cache.
        self.receiver = KVReceiver(self.layout, self.cache.pool, self.transport,
                                   same_host=handoff.kv_same_host,
                                   buffer_device=_buffer_device(stage_config))

    def describe(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "kv_session": self.transport.session_id,
                "kv_layout": self.layout.to_dict(), FINGERPRINT_KEY: self.fingerprint,
                "kv_miss_window_s": self.kv_miss_window_s}

    def _check(self, request: ThinkerRequest) -> None:
        kv_params = request.params.kv_transfer_params
        if not kv_params or not kv_params.get("do_remote_prefill"):
            return  # no remote KV: prefilled here
        descriptor = KVDescriptor.from_params(kv_params)
        if descriptor.num_tokens != request.prompt_len:
            raise ValueError(f"request {request.request_id}: transfer {descriptor.transfer_id} holds "
                             f"KV for {descriptor.num_tokens} tokens but the prompt has "
                             f"{request.prompt_len}")
        for key in ("first_token", "rope_deltas"):
            if not _is_int(kv_params.get(key)):
                raise ValueError(f"request {request.request_id}: kv_transfer_params[{key!r}] for "
                                 f"transfer {descriptor.transfer_id}: expected an int from the "
                                 f"prefill stage, got {kv_params.get(key)!r:.80}")
        self._wait_s(request.request_id, kv_params)
        staging = self.receiver.staging_blocks(descriptor)
        needed = staging + self.cache.blocks_for(request.prompt_len + request.params.max_tokens)
        if staging and needed > self.cache.num_blocks:
            raise ValueError(f"request {request.request_id}: transfer {descriptor.transfer_id} "
                             f"stages into {staging} KV blocks besides the request's own, "
                             f"{needed} in all; stage {self.stage_id} has {self.cache.num_blocks}; "
                             "raise engine_args.kv_pool_blocks")
        request.kv = descriptor

    def _wait_s(self, request_id: str, kv_params: dict[str, Any]) -> float:
        value = kv_params.get("kv_wait_s")
        if value is None:
            return self.kv_miss_window_s
        # 0 is a wait that has run out already (the orchestrator's deadline): a miss, unless
        # the KV is there by the first poll.
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise ValueError(f"request {request_id}: kv_transfer_params['kv_wait_s'] must be a "
                             f"number of seconds >= 0, got {value!r:.80}")
        return float(value)

    def _match_prefix(self, request: ThinkerRequest) -> list[int]:
        """For a prompt whose KV arrives from the prefill leg: the blocks of it this engine
        holds already (an earlier turn's), so that only the rest moves. Blocks are named here
        without the talker's rows, which stay with the prefill leg, so a prompt this engine
        prefills itself (the fallback) does not reuse them."""
        if (request.prefills_here or not self.prefix_caching
                or request.kv.kv_layout != self.layout):
            return []
        if request.params.kv_transfer_params.get("kv_cacheable") is False:
            request.cacheable = False
            return []
        return self.cache.prefix.match(request.prompt.prompt_token_ids, request.extra_keys,
                                       limit=request.prompt_len)

    def _start(self, request: ThinkerRequest) -> list[StepOutput]:
        if request.prefills_here:
            log.debug("request %s: no remote KV, prefilling %d prompt tokens here",
                      request.request_id, request.prompt_len)
            return self._prefill_here(request)
        kv_params = request.params.kv_transfer_params
        self.peers.check(request.kv.remote_engine_id, kv_params.get(FINGERPRINT_KEY))
        # The blocks this engine holds already stay; only the rest of the prompt moves.
        reused = request.cached_len // self.block_size
        request.reused, request.cached_len = request.blocks[:reused], 0
        request.metrics.update(kv_reused_tokens=reused * self.block_size,
                               kv_bytes_reused=reused * self.block_size * self.layout.bytes_per_token)
        if reused == len(request.kv.remote_block_ids):  # the whole prompt is here
            request.reused = []  # they stay among the request's blocks
            request.metrics.update(kv_transfer_ms=0.0, kv_bytes_transferred=0, kv_path="cached")
            request.rope_deltas = int(kv_params["rope_deltas"])
            return self._first_token(request, int(kv_params["first_token"]))
        descriptor = request.kv.without_first(reused) if reused else request.kv
        # The prompt's blocks go to the receiver for the read and come back with the result;
        # the request keeps the blocks its output will fill.
        prompt_blocks = self.receiver.dest_blocks(descriptor)
        self.receiver.start(descriptor, self._wait_s(request.request_id, kv_params),
                            into=request.blocks[reused:reused + prompt_blocks])
        request.blocks = request.blocks[reused + prompt_blocks:]
        request.phase = Phase.FETCHING
        self._last_fetch_start = time.perf_counter()
        self._fetching.append(request.request_id)
        log.debug("request %s: reading %d prompt tokens of KV as transfer %s from %s",
                  request.request_id, request.prompt_len, request.kv.transfer_id,
                  request.kv.remote_session)
        # A same-host copy is complete already: the first token leaves in this step.
        fetched = self.receiver.poll(request.kv.transfer_id)
        return self._fetched(request, fetched) if fetched is not None else []

    def _name_blocks(self, request: ThinkerRequest) -> None:
        """Name the prompt's full blocks, arrived or reused, for the next turn's handoff."""
        if self.prefix_caching and request.kv.kv_layout == self.layout and request.cacheable:
            full = request.prompt_len // self.block_size
            self.cache.prefix.register(request.blocks[:full], request.prompt.prompt_token_ids,
                                       request.extra_keys)

    def _progress(self) -> list[StepOutput]:
        self.receiver.reclaim()
        outputs: list[StepOutput] = []
        for request in [self._requests[r] for r in self._fetching]:
            try:
                fetched = self.receiver.poll(request.kv.transfer_id)
                if fetched is not None:
                    outputs.extend(self._fetched(request, fetched))
            except Exception as exc:  # this request's transfer failed or timed out
                log.debug("stage %d: request %s: %s: %s", self.stage_id, request.request_id,
                          type(exc).__name__, exc)
                if request.request_id in self._requests:
                    self._drop(request)
                outputs.append(StepOutput.failed(request.request_id, f"{type(exc).__name__}: {exc}"))
        return outputs

    def _fetched(self, request: ThinkerRequest, fetched) -> list[StepOutput]:
        self._fetching.remove(request.request_id)
        request.phase = Phase.RUNNING
        # The KV is in them already: the reused blocks, the arrived ones, then the output's.
        request.blocks = request.reused + fetched.blocks + request.blocks
        request.reused = []
        self._name_blocks(request)
        kv_params = request.params.kv_transfer_params
        request.rope_deltas = int(kv_params["rope_deltas"])
        request.metrics.update(kv_transfer_ms=fetched.transfer_ms,
                               kv_bytes_transferred=fetched.bytes_transferred, kv_path=fetched.path)
        return self._first_token(request, int(kv_params["first_token"]))

    def _can_start(self, request: ThinkerRequest) -> bool:
        # Blocks in quarantine come back only when Mooncake ends their reads: wait. A read in
        # place needs only the request's own blocks; one whose layout differs stages too.
        if request.prefills_here:
            return True
        staging = self.receiver.staging_blocks(request.kv)
        return staging == 0 or staging + self.cache.blocks_for(
            request.prompt_len + request.params.max_tokens) <= self.cache.num_free

    def _release(self, request: ThinkerRequest) -> None:
        if request.phase is Phase.FETCHING:
            # Mooncake may still write the prompt's blocks: the receiver quarantines them.
            self.receiver.abandon(request.kv.transfer_id, f"request {request.request_id} left")
        self.cache.release(request.reused)  # the cached blocks it held while the rest moved
        request.reused = []

    def step_delay_s(self) -> float:
        # Nothing decodes: every admitted request waits on its read, and a request still
        # waiting after a step could not be admitted (it waits for slots or blocks that only
        # the end of a read or quarantine frees). Stepping again at once would only spin.
        if not self._requests or self._running:
            return 0.0
        young = time.perf_counter() - self._last_fetch_start < FETCH_FAST_WINDOW_S
        return FETCH_FAST_POLL_S if young else FETCH_POLL_S

    def housekeeping(self) -> None:
        self.receiver.reclaim()

    def _output(self, request: ThinkerRequest, reason: str, embeds: torch.Tensor,
                hidden: torch.Tensor) -> ThinkerOutput:
        output = super()._output(request, reason, embeds, hidden)
        if not request.prefills_here:
            output.prompt_embeds = output.prompt_hidden = None  # they stay with the prefill leg
            output.num_cached_prompt_tokens = request.prompt_len
        return output

    def debug_state_counts(self) -> dict[str, int]:
        return {**super().debug_state_counts(), **self.receiver.debug_state_counts()}

    def _blocks_lent(self) -> int:
        return self.receiver.blocks_held

    def close(self) -> None:
        self.receiver.close()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
