"""An autoregressive stage as a continuously batched engine, for any model's `ArRunner`.

The loop is vLLM's: schedule, execute, update. Each step
1. lets the runner take input appended since the last step (`before_step`), and picks the
   running requests that decode (ready ones, before this step's KV reads complete);
2. schedules (`Scheduler.schedule`): decodes first, then prompt chunks within the token budget
   (chunked prefill), blocks allocated as positions need them, the newest request preempted when
   they run out, waiting requests admitted (the prefix cache's blocks first);
3. computes the step's prompt chunks in one batched pass (`runner.prefill`); a prompt whose last
   chunk ran starts: this role takes its first token here, the prefill leg publishes its KV, the
   decode leg reads its KV from the prefill engine (`pd_legs.py`);
4. advances every decoding request by one token in one batched pass (`runner.decode`), samples
   (`runner.sample`) and stops the finished ones (`runner.finish_reason`).

A request's state lives in one `EngineRequest` (request.py has its lifecycle), held by the
scheduler from `add_request` until it finishes, fails or is aborted; its blocks go back to the
KV manager on each of those paths. A batched prefill that fails is retried request by request,
so only the requests that fail alone fail.

Chunked = whole, bit for bit: a chunk attends to the KV of the chunks before it in the request's
blocks, as a prompt over a cached prefix does, and the runners' passes are row-invariant. A
preempted request is computed again the same way (its prompt, then one decode row a step), so
its tokens are its unpreempted run's; the engine checks each against the ones it had sent.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import torch

from ... import hops
from ...sampling import SamplingParams
from ..base import BatchStats, StageEngine, StepOutput
from .attention import SequenceSlot, StepAttention
from .kv_manager import KVManager
from .paged_cache import PagedKVCache
from .prefix_cache import OMNI_PD_NAMING, multimodal_extra_keys, naming_for
from .request import EngineRequest, Phase
from .fallback import each_alone
from .runner import ArRunner, PrefillItem, Prefilled
from .scheduler import Chunk, Scheduler

log = logging.getLogger(__name__)


class ArEngine(StageEngine):
    """The colocated role: prefill, then batched decode, in one engine."""

    control_calls = StageEngine.control_calls | {"set_batch_invariant"}
    decodes = True  # the prefill leg never decodes
    # Whether a prompt this engine prefills may start from cached blocks (and so needs the rows
    # of cached blocks kept); the decode leg's fallback prefills whole.
    prefills_over_cache = True

    def __init__(self, stage_config, runner: ArRunner):
        self.stage_id = stage_config.stage_id
        self.runner = runner
        self.name = runner.name
        args = stage_config.engine_args
        self.block_size = args.kv_block_size
        self.max_num_seqs = stage_config.max_num_seqs
        self.max_num_batched_tokens = stage_config.max_num_batched_tokens
        # vLLM's key and default: on. Prompts of a runner that cannot chunk are computed whole.
        self.chunked_prefill = args.enable_chunked_prefill is not False
        # vLLM's key, on unless the file turns it off, for a runner whose prompts have ids.
        self.prefix_caching = args.enable_prefix_caching is not False and runner.caches_prefixes
        self.device = runner.device  # the cache lives with the model
        keep_rows = self.prefix_caching and self.prefills_over_cache
        self.kv = KVManager(
            runner.kv_layout(self.block_size),
            args.kv_pool_blocks,
            shared=self.shares_cache(stage_config),
            prefix_caching=self.prefix_caching,
            device=self.device,
            row_widths=runner.row_widths if keep_rows else None,
            row_dtype=runner.row_dtype,
            naming=naming_for(args.prefix_caching_hash_algo) if self.prefix_caching else OMNI_PD_NAMING,
        )
        self.layout = self.kv.layout
        self.scheduler = Scheduler(
            self.kv, self.max_num_seqs, self.max_num_batched_tokens, chunked=self.chunked_prefill
        )
        self._stats = BatchStats()
        log.info(
            "stage %d: %s engine, max_num_seqs %d, max_num_batched_tokens %d, chunked prefill %s, "
            "%d KV blocks of %d tokens, prefix caching %s",
            self.stage_id,
            self.name,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            "on" if self.chunked_prefill and runner.prefills_in_chunks else "off",
            args.kv_pool_blocks,
            self.block_size,
            f"on, blocks named {self.kv.naming.describe()}" if self.prefix_caching else "off",
        )

    # ---- the request lifecycle ---------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        stream: bool = False,
        chunks: bool = False,
        chunk_sizes: tuple[int, int] | None = None,
        rows: bool = True,
    ) -> None:
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request {request_id} is already in stage {self.stage_id}")
        if chunk_sizes is not None and (len(chunk_sizes) != 2 or min(chunk_sizes) < 1):
            raise ValueError(
                f"request {request_id}: chunk_sizes must be two counts >= 1 (first "
                f"chunk, later chunks), got {chunk_sizes!r}"
            )
        request = self.new_request(request_id, prompt, params)
        hops.stamp(request.metrics, "added")
        request.stream, request.chunks, request.rows = stream or chunks, chunks, rows
        request.chunk_sizes = (chunk_sizes[0], chunk_sizes[1]) if chunk_sizes is not None else None
        if request.prompt_len == 0:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        self._check(request)
        if (
            request.prefills_here
            and not self.chunked_prefill
            and request.prompt_len > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"request {request_id}: the prompt has {request.prompt_len} positions, "
                f"over stage {self.stage_id}'s max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with enable_chunked_prefill false; raise "
                "max_num_batched_tokens, turn chunked prefill on, or shorten the prompt"
            )
        # Blocks are allocated as positions need them, but a request must fit the pool alone.
        needed = self.kv.blocks_for(request.prompt_len + params.max_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"request {request_id}: prompt plus max_tokens need {needed} KV "
                f"blocks, stage {self.stage_id} has {self.kv.num_blocks}; raise "
                "engine_args.kv_pool_blocks or lower max_tokens"
            )
        self.scheduler.add(request)

    def new_request(self, request_id: str, prompt: Any, params: SamplingParams) -> EngineRequest:
        """The runner's checked record of a request, with its blocks' extra keys (the prefix
        cache names a block holding a multimodal input by that input's content too)."""
        request = self.runner.new_request(request_id, prompt, params)
        request.extra_keys = multimodal_extra_keys(
            request.multimodal_spans, request.prompt_len, self.block_size
        )
        return request

    def append_input(self, request_id: str, data: Any, final: bool) -> None:
        request = self.scheduler.get(request_id)
        if request is None:
            raise ValueError(f"stage {self.stage_id} holds no request {request_id}")
        self.runner.append_input(request, data, final)

    @staticmethod
    def shares_cache(stage_config) -> bool:
        """Whether the paged cache lives in shared memory (the prefill leg's, same-host path)."""
        return False

    def _check(self, request: EngineRequest) -> None:
        """Role-specific validation (kv_transfer_params); may set `request.kv`."""

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.get(request_id)
        if request is not None:
            self._drop(request)
            log.debug("stage %d: request %s aborted", self.stage_id, request_id)

    def _drop(self, request: EngineRequest) -> None:
        self.scheduler.remove(request)
        self._release(request)
        if request.blocks:
            self.kv.free(request.blocks)
            request.blocks = []

    def _release(self, request: EngineRequest) -> None:
        """Role-specific resources of a request that leaves (the decode leg's KV read)."""

    def has_unfinished_requests(self) -> bool:
        s = self.scheduler
        if s.waiting or s.fetching or s.prefilling:
            return True
        running = [s.requests[r] for r in s.running]
        return any(self.runner.ready(r) for r in running) or self.runner.pending(running)

    def request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def debug_state_counts(self) -> dict[str, int]:
        return {
            f"{self.name}.requests": len(self.scheduler.requests),
            f"{self.name}.kv_blocks_in_use": self.kv.num_used - self._blocks_lent(),
        }

    def load(self) -> dict[str, int]:
        load = {
            "requests": len(self.scheduler.requests),
            "waiting": len(self.scheduler.waiting),
            "running": self.scheduler.num_running,
            "preemptions": self.scheduler.num_preemptions,
            # Blocks requests and leases hold (idle cached blocks are free: vLLM's usage).
            "used_kv_blocks": self.kv.num_blocks - self.kv.num_free,
            "free_kv_blocks": self.kv.num_free,
            "kv_blocks": self.kv.num_blocks,
            "kv_block_size": self.block_size,
        }
        if self.prefix_caching:  # counters since start: Prometheus derives the hit rate
            load.update(
                prefix_cache_queries=self.kv.query_tokens,
                prefix_cache_hits=self.kv.hit_tokens,
                prefix_cached_blocks=self.kv.num_cached,
            )
        return load

    def _blocks_lent(self) -> int:
        """Cache blocks another owner holds now (the decode leg's KV reads)."""
        return 0

    def describe(self) -> dict[str, Any]:
        return self.runner.describe()

    def batch_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self._stats)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Test hook: plain (batch-dependent) linear layers in this worker when False."""
        self.runner.compute.set_batch_invariant(enabled)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        s = self.scheduler
        outputs = [
            self._fail(r, why)
            for r, why in self.runner.before_step(
                [s.requests[r] for r in s.running + s.prefilling + list(s.waiting)]
            )
        ]
        decoding = s.decoding(self.runner.ready)
        # Requests whose KV arrived get their first token now and decode from the next step, as
        # an admitted prompt does.
        outputs.extend(self._progress())
        plan = s.schedule(decoding, self._match_prefix, self._can_start, self._can_chunk)
        for request in plan.preempted:
            self._preempted(request)
        for request in plan.admitted:
            if self.prefix_caching and request.prefills_here and request.batchable:
                self.kv.count_query(request.prompt_len, request.cached_len)
        self._stats.record(
            len(plan.admitted),
            len(plan.decode),
            len(plan.decode) + sum(c.end - c.start for c in plan.chunks),
            sum(not c.final for c in plan.chunks),
        )
        for request in plan.admitted:
            if not request.prefills_here:  # its KV comes by transfer: the role starts it
                outputs.extend(self._start_or_fail(request))
        outputs.extend(self._prefill_chunks(plan.chunks))
        if plan.decode:
            outputs.extend(self._decode(plan.decode))
        return outputs

    def _start_or_fail(self, request: EngineRequest) -> list[StepOutput]:
        try:
            return self._start(request)
        except Exception as exc:
            log.debug(
                "stage %d: request %s failed to start", self.stage_id, request.request_id, exc_info=True
            )
            return [self._fail(request, f"{type(exc).__name__}: {exc}")]

    def _can_chunk(self, request: EngineRequest) -> bool:
        """Whether a prompt may be computed over several steps: the runner's batched pass takes
        it and honours chunk ends (a pushed prompt prefills in its own chunks at its start)."""
        return self.runner.prefills_in_chunks and request.batchable and self._batches(request)

    def _preempted(self, request: EngineRequest) -> None:
        """Reset a request the scheduler preempted (its blocks are freed): it is computed again
        from its prompt, here (a decode leg's request whose KV came from a prefill engine is
        prefilled here too), and its tokens must come out as the ones it had."""
        request.vllm_kv = None  # its pull is done: nothing to tell its producer
        self._release(request)
        if len(request.tokens) > len(request.replay):
            request.replay = request.tokens
        request.tokens = []
        request.cached_len = request.computed = 0
        request.chunk_rows, request.chunk_ms, request.prefilled = [], 0.0, None
        request.kv = request.pushed = request.vllm_kv = None
        self.runner.restart(request)
        request.metrics["preemptions"] = request.metrics.get("preemptions", 0) + 1
        log.debug("stage %d: request %s preempted (KV blocks ran out)", self.stage_id, request.request_id)

    def _fail(self, request: EngineRequest, error: str) -> StepOutput:
        if self.scheduler.get(request.request_id) is request:
            self._drop(request)
        return StepOutput.failed(request.request_id, error)

    def _progress(self) -> list[StepOutput]:
        """Advance requests that wait on I/O (the decode leg's KV reads); none here."""
        return []

    def _batches(self, request: EngineRequest) -> bool:
        """Whether an admitted prompt joins the step's batched prefill (a pushed one prefills in
        chunks at its start instead)."""
        return True

    def _can_start(self, request: EngineRequest) -> bool:
        """Role-specific resources a request needs to be admitted (beyond cache blocks)."""
        return True

    def _start(self, request: EngineRequest) -> list[StepOutput]:
        return self._prefill_here(request)

    # ---- the prefix cache ----------------------------------------------------------------------
    def _match_prefix(self, request: EngineRequest) -> list[int]:
        """The cached blocks holding the longest prefix of a prompt this engine prefills, held
        for it now; none without prefix caching, and none for prompts the batched pass does not
        take (whose rows depend on the prompt's length). Blocks with multimodal inputs match
        only the same inputs (their extra keys). The last prompt position is always computed:
        its logits give the first token."""
        if not (self.prefix_caching and request.prefills_here and request.batchable and request.cacheable):
            return []
        return self.kv.match(self._prompt_ids(request), request.extra_keys, limit=request.prompt_len - 1)

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        """The prompt's token ids, which the prefix cache names blocks by: a runner that caches
        prefixes gives every prompt its ids."""
        if request.token_ids is None:
            raise RuntimeError(
                f"stage {self.stage_id}: request {request.request_id}: the prefix cache needs the "
                "prompt's token ids, but its runner gave none"
            )
        return request.token_ids

    def _cache_prompt(self, request: EngineRequest, pre: Prefilled, checksums: Sequence[str] = ()) -> None:
        """Name the prompt's full blocks for later prompts, with their rows (and, on the prefill
        leg, the checksums they were published with)."""
        if not (self.prefix_caching and request.batchable and request.cacheable):
            return
        full = request.prompt_len // self.block_size
        if self.kv.keeps_rows:
            self.kv.keep_rows(request.blocks, request.cached_len // self.block_size, full, pre.rows, 0)
        self.kv.register(
            request.blocks[:full], self._prompt_ids(request), request.extra_keys, checksums=checksums
        )

    # ---- prefill -------------------------------------------------------------------------------
    def _prefill_chunks(self, chunks: list[Chunk]) -> list[StepOutput]:
        """The step's prompt chunks: the batchable ones in one pass (each alone if it fails, so
        only the ones that fail alone fail), their KV written at once; a prompt whose last chunk
        ran starts. The others (a whole prompt of the runner's own path, a pushed one) start
        and prefill there."""
        batched = [c for c in chunks if c.request.batchable and self._batches(c.request)]
        outputs: list[StepOutput] = []
        failed: list[tuple[EngineRequest, Exception]] = []
        began = time.perf_counter()
        done = each_alone(
            batched,
            lambda some: self.compute_prefill([PrefillItem(c.request, c.start, c.end) for c in some]),
            lambda chunk, exc: failed.append((chunk.request, exc)),
            f"stage {self.stage_id}: prefill",
        )
        elapsed = (time.perf_counter() - began) * 1e3
        outputs.extend(self._fail(r, f"{type(exc).__name__}: {exc}") for r, exc in failed)
        for chunk, part in done:
            request = chunk.request
            request.chunk_ms += elapsed
            if not chunk.final:
                self.kv.write(request.blocks, chunk.start, part.computed_kv)
                request.chunk_rows.append(part.rows)
                request.computed = chunk.end
                continue
            try:
                request.prefilled = self._take_first_token(
                    request, self._joined(request, part), request.chunk_ms
                )
            except Exception as exc:  # noqa: BLE001 - this request alone
                outputs.append(self._fail(request, f"{type(exc).__name__}: {exc}"))
                continue
            outputs.extend(self._started(request))
        whole = [c.request for c in chunks if not (c.request.batchable and self._batches(c.request))]
        outputs.extend(o for request in whole for o in self._started(request))
        return outputs

    def _joined(self, request: EngineRequest, last: Prefilled) -> Prefilled:
        """A prompt's prefill from its last chunk and the ones before (their KV in its blocks,
        their rows kept): what one pass from `cached_len` gives."""
        if not request.chunk_rows:
            return last
        start = request.prompt_len - last.computed_kv.shape[3]
        earlier = self.kv.cache.read(request.blocks, start)[:, :, :, request.cached_len :]
        rows = {
            name: torch.cat([*(r[name] for r in request.chunk_rows), last.rows[name]]) for name in last.rows
        }
        request.chunk_rows = []
        return Prefilled(last.logits, torch.cat([earlier, last.computed_kv], dim=3), rows, dict(last.state))

    def _started(self, request: EngineRequest) -> list[StepOutput]:
        """A prompt computed (or one the role computes at its start): it leaves PREFILLING."""
        self.scheduler.prefilling.remove(request.request_id)
        request.phase = Phase.RUNNING
        request.computed = request.prompt_len
        return self._start_or_fail(request)

    def compute_prefill(self, items: Sequence[PrefillItem]) -> list[Prefilled]:
        """One batched prefill pass of the runner over `items`, through this step's attention
        (each prompt's blocks, cached prefix and new positions): each result with its KV."""
        for item in items:
            hops.stamp(item.request.metrics, "prefill started")
        attention = prefill_attention(self.runner, self.kv.cache, items)
        results = self.runner.prefill(items, attention)
        for index, result in enumerate(results):
            if result.kv is None:
                result.kv = attention.prompt_kv(index)
        return results

    def _take_first_token(self, request: EngineRequest, result: Prefilled, elapsed_ms: float) -> Prefilled:
        [first] = self.runner.sample([request], result.logits.unsqueeze(0), first=True)
        if isinstance(first, Exception):
            raise first
        if request.cached_len and result.rows:
            # The cached positions' rows were kept beside their blocks.
            cached = self.kv.cached_rows(request.blocks[: request.cached_len // self.block_size])
            result.rows = {name: _cat(cached[name], rows) for name, rows in result.rows.items()}
        result.first_token, result.prefill_ms = first, elapsed_ms
        return result

    def _prefill(self, request: EngineRequest) -> Prefilled:
        """The request's prefill: its share of the step's batched pass, or run now (alone
        through the batched pass, or the runner's whole-prompt path)."""
        pre, request.prefilled = request.prefilled, None
        if pre is not None:
            return pre
        began = time.perf_counter()
        if request.batchable:
            [result] = self.compute_prefill([PrefillItem(request, request.cached_len)])
            return self._take_first_token(request, result, (time.perf_counter() - began) * 1e3)
        hops.stamp(request.metrics, "prefill started")
        result = self.runner.prefill_alone(request)
        return self._take_first_token(request, result, (time.perf_counter() - began) * 1e3)

    def _prefill_here(self, request: EngineRequest) -> list[StepOutput]:
        """Prefill the prompt into the request's blocks and take its first token."""
        pre = self._prefill(request)
        self.kv.write(request.blocks, request.cached_len, pre.computed_kv)
        self._cache_prompt(request, pre)
        self.runner.prefilled(request, pre)
        request.metrics.setdefault("prefill_ms", pre.prefill_ms)  # the first one's, if preempted
        assert pre.first_token is not None, "_prefill samples the first token"
        return self._first_token(request, pre.first_token)

    def _first_token(self, request: EngineRequest, token: int) -> list[StepOutput]:
        """A request has its first token: it runs (decodes from the next step) or is done."""
        if (diverged := self._append(request, token)) is not None:
            return [self._fail(request, diverged)]
        request.metrics.setdefault("first_token_ms", request.elapsed_ms())
        reason = self.runner.finish_reason(request)
        if reason is not None:
            return [self._finish(request, reason)]
        if request.request_id not in self.scheduler.running:
            self.scheduler.running.append(request.request_id)
        delta = self._delta(request)
        return [delta] if delta is not None else []

    # ---- decode --------------------------------------------------------------------------------
    def _decode(self, batch: list[EngineRequest]) -> list[StepOutput]:
        try:
            result = self.runner.decode(batch, decode_attention(self.runner, self.kv.cache, batch))
            tokens = self.runner.sample(batch, result.logits, first=False)
        except Exception as exc:  # noqa: BLE001 - the batched pass: fail its requests
            log.exception(
                "stage %d: %s decode step failed for %d requests", self.stage_id, self.name, len(batch)
            )
            return [self._fail(r, f"{self.name} decode step failed: {exc}") for r in batch]
        outputs = []
        for request, token in zip(batch, tokens):
            if isinstance(token, Exception):
                outputs.append(self._fail(request, f"{self.name}: {token}"))
                continue
            if (diverged := self._append(request, token)) is not None:
                outputs.append(self._fail(request, diverged))
                continue
            reason = self.runner.finish_reason(request)
            if reason is not None:
                outputs.append(self._finish(request, reason))
            elif (delta := self._delta(request)) is not None:
                outputs.append(delta)
        return outputs

    def _append(self, request: EngineRequest, token: int) -> str | None:
        """Append a sampled token; a request computed again after preemption must sample the
        tokens it had (None), else why it fails."""
        index = len(request.tokens)
        if index < len(request.replay) and token != request.replay[index]:
            return (
                f"{self.name}: request {request.request_id} computed again after preemption "
                f"sampled {token} as token {index}, not the {request.replay[index]} it had sent "
                "(its computation is not batch-invariant)"
            )
        request.tokens.append(token)
        if index < 2:
            hops.stamp(request.metrics, f"token {index + 1}")
        return None

    def _delta(self, request: EngineRequest) -> StepOutput | None:
        """A streamed request's new tokens and chunk since the last one (the runner says what
        they are); None when it has nothing new to send (nor while a preempted request is
        computed again up to what it had sent)."""
        if not request.stream or len(request.tokens) <= len(request.replay):
            return None
        new, chunk = self._stream_out(request, False)
        if not new and chunk is None:
            return None
        hops.stamp(request.metrics, "first delta out")
        return StepOutput(request.request_id, new_token_ids=new, chunk=chunk)

    def _finish(self, request: EngineRequest, reason: str) -> StepOutput:
        request.metrics["e2e_ms"] = request.elapsed_ms()
        hops.stamp(request.metrics, "finished")
        output = self._output(request, reason)
        self._drop(request)
        new, chunk = self._stream_out(request, True) if request.stream else ([], None)
        return StepOutput(request.request_id, new_token_ids=new, chunk=chunk, finished=True, output=output)

    def _stream_out(self, request: EngineRequest, finished: bool) -> tuple[list[int], Any]:
        """A streamed request's new text tokens since the last call and its chunk (the runner
        builds it), counted here."""
        new = request.tokens[request.streamed :] if self.runner.emits_text else []
        request.streamed = len(request.tokens)
        chunk = self.runner.chunk(request, new, request.chunks_sent == 0, finished)
        if chunk is not None:
            request.chunks_sent += 1
        return new, chunk

    def _output(self, request: EngineRequest, reason: str) -> Any:
        """The runner's output record, with what the engine counted in its metrics (the prompt
        positions the prefix cache gave)."""
        request.metrics["prefix_cached_tokens"] = request.cached_len
        return self.runner.output(request, reason)


def prefill_attention(runner: ArRunner, cache: PagedKVCache, items: Sequence[PrefillItem]) -> StepAttention:
    """The attention of one prefill pass of `runner` over `items`: each prompt's blocks, its
    cached prefix (or earlier chunks) and the positions it computes now."""
    slots = [
        SequenceSlot(
            i.request.blocks, i.start, (i.end if i.end is not None else i.request.prompt_len) - i.start
        )
        for i in items
    ]
    return StepAttention.for_prefill(runner.compute, cache, slots, runner.prompt_attention)


def decode_attention(
    runner: ArRunner, cache: PagedKVCache, requests: Sequence[EngineRequest]
) -> StepAttention:
    """The attention of one decode step of `requests`: one new position each, at `position`."""
    return StepAttention.for_decode(
        runner.compute, cache, [SequenceSlot(r.blocks, r.position, 1) for r in requests]
    )


def _cat(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return torch.cat([first, second])
