"""The two legs of a P/D pair, for any autoregressive runner.

The prefill leg only prefills: it writes each admitted prompt's KV into its paged cache, leases
those blocks to its decode engine (`kv.KVSender`: registered with Mooncake once, and in shared
memory for the same-host path), and answers with the first token, vLLM's kv_transfer_params keys
and its own (block table, layout, checksums, the runner's handoff state). The decode leg admits
a request whose kv_transfer_params carry do_remote_prefill by submitting the KV read into the
request's blocks (`kv.KVReceiver`); each step polls the reads without blocking, bounded by the
request's miss window, and a request whose KV arrived and checked out takes its first token from
the prefill and decodes. A request without remote KV is prefilled on the decode leg, as the
colocated engine does (the orchestrator's fallback when the prefill peer is dead, frozen or
broken). Both legs check each other's KV fingerprint (model, weights, geometry, and what they
compute with) at the first handoff between them.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from typing import Any, Sequence

from ... import faults, hops
from ...kv import KVDescriptor, KVReceiver, KVSender
from ...kv.transport import open_transport
from ...kv.fingerprint import FINGERPRINT_KEY, PeerFingerprints, kv_fingerprint
from ...kv.push import RECORD_KEY, TARGET_KEY, KVPusher, PushReservations
from ...kv.vllm.consumers import VllmConsumers
from ...kv.vllm.source import VllmKVSource, from_vllm
from ..base import StepOutput
from .ar_engine import ArEngine
from .request import EngineRequest, Phase
from .runner import ArRunner, Prefilled
from . import push_legs
from .transfer_settings import TransferSettings

log = logging.getLogger(__name__)

# How long a decode worker whose every request waits on a KV read sleeps between polls: far
# below a transfer's milliseconds of latency, far above a poll's microseconds of CPU.
FETCH_POLL_S = 0.002
# A small read lands within a few milliseconds: poll it closely at first, so the poll interval
# does not add to the handoff (the 2 ms interval tripled the tiny model's 40-token handoff).
FETCH_FAST_POLL_S, FETCH_FAST_WINDOW_S = 0.0002, 0.010


def engine_fingerprint(runner: ArRunner, layout, engine_id: str) -> dict[str, Any]:
    identity = runner.identity()
    return kv_fingerprint(
        identity.model,
        identity.weights,
        layout,
        engine_id,
        runner.compute.compute_identity(identity.device, identity.native_kernels),
    )


def _log_fingerprint(stage_id: int, name: str, role: str, fingerprint: dict[str, Any]) -> None:
    log.info(
        "stage %d: %s %s engine KV fingerprint %s",
        stage_id,
        name,
        role,
        json.dumps(fingerprint, sort_keys=True),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kv_params(request: EngineRequest) -> dict[str, Any]:
    """The kv_transfer_params of a request that a leg's _check found carrying them."""
    params = request.params.kv_transfer_params
    assert params is not None, f"request {request.request_id} has no kv_transfer_params"
    return params


def _remote_kv(request: EngineRequest) -> KVDescriptor:
    """A decode-leg request's remote prompt KV (None only for a prompt prefilled here)."""
    assert request.kv is not None, f"request {request.request_id} has no remote KV"
    return request.kv


class PrefillEngine(ArEngine):
    """The prefill leg: prefills each admitted prompt and publishes its KV for the decode leg,
    answering with the first token."""

    decodes = False
    control_calls = ArEngine.control_calls | {"release_kv", "vllm_serve_stats"}

    @staticmethod
    def shares_cache(stage_config) -> bool:
        return TransferSettings.of(stage_config).handoff.kv_same_host != "off"

    def __init__(self, stage_config, runner: ArRunner):
        super().__init__(stage_config, runner)
        settings = TransferSettings.of(stage_config)
        self.engine_id = settings.engine_id or f"prefill-{uuid.uuid4().hex[:12]}"
        self.transport = open_transport(settings.host, settings.protocol)
        self.fingerprint = engine_fingerprint(runner, self.layout, self.engine_id)
        _log_fingerprint(self.stage_id, self.name, "prefill", self.fingerprint)
        # The paged cache is what is published: registered once, its blocks leased as they are.
        self.sender = KVSender(
            self.engine_id,
            self.layout,
            self.kv.cache.pool,
            self.transport,
            stage_config.engine_args.kv_lease_timeout_s,
            buffer_device=settings.buffer_device,
            same_host=settings.handoff.kv_same_host != "off",
        )
        # Push mode: writes prompt blocks into the decode side's reservations (push_legs.py).
        self.pusher = KVPusher(self.transport, self.sender.pool, self.sender.landing, self.kv.free)
        self.push_chunk_tokens = settings.handoff.kv_push_chunk_tokens
        # Unmodified vLLM decode engines as this leg's peers (kv/vllm/consumers.py), when asked for.
        self.vllm_consumers: VllmConsumers | None = None
        if settings.handoff.serve_vllm_consumers:
            self.vllm_consumers = VllmConsumers(
                self.stage_id,
                self.engine_id,
                self.layout,
                self.transport,
                self.kv.naming.scheme,
                self.kv.naming.seed_rule,
                runner.identity().model,
                self.kv.num_blocks,
                stage_config.engine_args.kv_lease_timeout_s,
            )

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "engine_id": self.engine_id,
            "kv_session": self.transport.session_id,
            "kv_layout": self.layout.to_dict(),
            FINGERPRINT_KEY: self.fingerprint,
        }

    def _check(self, request: EngineRequest) -> None:
        kv_params = request.params.kv_transfer_params or {}
        if not kv_params.get("do_remote_decode") or not kv_params.get("transfer_id"):
            raise ValueError(
                f"request {request.request_id}: a prefill-only stage needs "
                "kv_transfer_params with do_remote_decode=true and a transfer_id (the "
                "orchestrator's P/D planning sets them)"
            )
        request.publishes = True
        if kv_params.get(TARGET_KEY) is not None:
            push_legs.check_target(self, request, kv_params[TARGET_KEY])

    def _batches(self, request: EngineRequest) -> bool:
        return request.push_target is None  # a pushed prompt prefills in chunks at its start

    def _prompt_checksums(self, request: EngineRequest) -> list[str]:
        """The prompt blocks' checksums as they lie now (the cached ones' as they were named)."""
        reused = request.cached_len // self.block_size
        return [self._named_checksum(b) for b in request.blocks[:reused]] + self.kv.checksums(
            request.blocks, request.prompt_len, first=reused
        )

    def _start(self, request: EngineRequest) -> list[StepOutput]:
        if request.push_target is not None:
            return push_legs.start_push(self, request)
        transfer_id = _kv_params(request)["transfer_id"]
        pre = self._prefill(request)
        assert pre.first_token is not None, "_prefill samples the first token"
        sums: list[str] | None
        if request.cached_len:
            # Cached blocks go with the checksums they were named with (memory that changed
            # since fails the handoff); the rest are checksummed as they now lie.
            self.kv.write(request.blocks, request.cached_len, pre.computed_kv)
            sums = self._prompt_checksums(request)
        else:  # block by block as written (each still in cache): no second pass at publish
            sums = self.kv.write(request.blocks, 0, pre.computed_kv, checksums=True)
            assert sums is not None, "write(checksums=True) returns them"
        self._cache_prompt(request, pre, sums)
        prompt_blocks = self.kv.blocks_for(request.prompt_len)
        if self.vllm_consumers is not None:  # a vLLM decode engine reads a translated copy
            where = self.vllm_consumers.offer(transfer_id, self.kv.cache.data, request.blocks[:prompt_blocks])
        else:
            descriptor = self.sender.publish_blocks(
                transfer_id, request.blocks[:prompt_blocks], request.prompt_len, checksums=sums
            )
            request.blocks = request.blocks[prompt_blocks:]  # the lease holds the prompt's blocks now
            where = {
                **descriptor.to_params(),
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_bootstrap_addr": f"mooncake://{self.transport.session_id}",
                FINGERPRINT_KEY: self.fingerprint,
            }
        out_params = {
            **where,
            "remote_request_id": request.request_id,
            "first_token": pre.first_token,
            **{key: pre.state[key] for key in self.runner.handoff_keys},
            # False: the decode side must neither reuse cached blocks for it nor cache these.
            "kv_cacheable": request.cacheable,
        }
        log.debug(
            "request %s: published %d prompt tokens as transfer %s",
            request.request_id,
            request.prompt_len,
            transfer_id,
        )
        hops.stamp(request.metrics, "kv published")
        self.runner.prefilled(request, pre)
        request.tokens.append(pre.first_token)
        hops.stamp(request.metrics, "token 1")
        request.metrics.update(first_token_ms=request.elapsed_ms(), prefill_ms=pre.prefill_ms)
        output = self._output(request, "length")  # the prompt's (request.publishes)
        output.kv_transfer_params = out_params
        self._drop(request)
        return [StepOutput(request.request_id, finished=True, output=output)]

    def _named_checksum(self, block: int) -> str:
        """A cached block's checksum: every prompt this engine names was published, and named
        with the checksums it was published with."""
        checksum = self.kv.checksum(block)
        assert checksum is not None, f"stage {self.stage_id}: cached KV block {block} has no checksum"
        return checksum

    def _match_prefix(self, request: EngineRequest) -> list[int]:
        if faults.take("prefill.uncacheable") is not None:  # test-only (omni_pd/faults.py)
            request.cacheable = False  # the oldest waiting request is the next one published
        return super()._match_prefix(request)

    def release_kv(self, transfer_id: str) -> bool:
        if self.vllm_consumers is not None:
            return self.vllm_consumers.release(transfer_id)
        return self.sender.release(transfer_id)

    def _consumers(self) -> VllmConsumers:
        if self.vllm_consumers is None:
            raise ValueError(
                f"stage {self.stage_id} serves no vLLM consumers (kv_connector_extra_config."
                "serve_vllm_consumers is not set)"
            )
        return self.vllm_consumers

    def vllm_serve_stats(self) -> dict[str, Any]:
        """What this leg wrote to vLLM decode engines (cumulative): sends, blocks, refusals."""
        return self._consumers().stats()

    def housekeeping(self) -> None:
        self.sender.expire_leases()
        self.pusher.reclaim()
        if self.vllm_consumers is not None:
            self.vllm_consumers.expire()

    def debug_state_counts(self) -> dict[str, int]:
        return {
            **super().debug_state_counts(),
            **self.sender.debug_state_counts(),
            **self.pusher.debug_state_counts(),
            **(self.vllm_consumers.debug_state_counts() if self.vllm_consumers is not None else {}),
        }

    def load(self) -> dict[str, int]:
        return {**super().load(), "kv_push_late_writes": self.pusher.late_writes}

    def _blocks_lent(self) -> int:
        return self.sender.blocks_held + self.pusher.blocks_held

    def close(self) -> None:
        self.sender.close()
        if self.vllm_consumers is not None:
            self.vllm_consumers.close()

    # ---- what push mode calls of this leg (push_legs.PushPrefillLeg) -------------------------
    def prefill_prompt(self, request: EngineRequest) -> Prefilled:
        return self._prefill(request)

    def take_first_token(self, request: EngineRequest, result: Prefilled, elapsed_ms: float) -> Prefilled:
        return self._take_first_token(request, result, elapsed_ms)

    def cache_prompt(self, request: EngineRequest, pre: Prefilled, checksums: Sequence[str] = ()) -> None:
        self._cache_prompt(request, pre, checksums)

    def prompt_checksums(self, request: EngineRequest) -> list[str]:
        return self._prompt_checksums(request)

    def request_output(self, request: EngineRequest, reason: str) -> Any:
        return self._output(request, reason)

    def drop_request(self, request: EngineRequest) -> None:
        self._drop(request)


class DecodeEngine(ArEngine):
    """The decode leg. The wait for a request's KV is bounded by `kv_wait_s` from its
    kv_transfer_params, else the stage's kv_miss_window_s; past it the request fails with
    KVMissError (and the orchestrator falls back)."""

    prefills_over_cache = False  # its blocks are named without their rows (_match_prefix)
    control_calls = ArEngine.control_calls | {"reserve_kv", "release_push"}

    def __init__(self, stage_config, runner: ArRunner):
        super().__init__(stage_config, runner)
        self._last_fetch_start = 0.0  # when the newest KV read started (perf_counter)
        settings = TransferSettings.of(stage_config)
        handoff = settings.handoff
        self.kv_miss_window_s = handoff.kv_miss_window_s
        self.engine_id = settings.engine_id or f"decode-{uuid.uuid4().hex[:12]}"
        # A read abandoned on a frozen peer holds its blocks until Mooncake gives up on
        # it: make that the handoff deadline rather than Mooncake's 30 s.
        self.transport = open_transport(
            settings.host, settings.protocol, progress_timeout_s=handoff.kv_handoff_deadline_s
        )
        self.fingerprint = engine_fingerprint(runner, self.layout, self.engine_id)
        _log_fingerprint(self.stage_id, self.name, "decode", self.fingerprint)
        self.peers = PeerFingerprints(
            self.fingerprint, require_identical_kernels=handoff.require_identical_kernels
        )
        # The KV lands where it is used: the receiver reads into blocks of the paged cache.
        self.receiver = KVReceiver(
            self.layout,
            self.kv.cache.pool,
            self.transport,
            same_host=handoff.kv_same_host,
            buffer_device=settings.buffer_device,
        )
        # Push mode: blocks reserved for the prefill leg to write (push_legs.py). A late writer
        # is fenced off for as long as a prefill leg holds a published lease.
        self.pushes = PushReservations(
            self.transport.session_id,
            self.kv.cache.pool,
            self.receiver.landing,
            self.kv.free,
            fence_s=stage_config.engine_args.kv_lease_timeout_s,
        )
        # KV from an unmodified vLLM prefill engine: staging made at the first such handoff.
        naming = self.kv.naming
        self.vllm = VllmKVSource(
            self.stage_id,
            self.layout,
            self.transport,
            naming.scheme,
            naming.seed_rule,
            runner.identity().model,
            self.kv.num_blocks,
        )
        if naming.scheme.startswith("vllm:"):
            self.vllm.log_fingerprint()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "engine_id": self.engine_id,
            "kv_session": self.transport.session_id,
            "kv_layout": self.layout.to_dict(),
            FINGERPRINT_KEY: self.fingerprint,
            "kv_miss_window_s": self.kv_miss_window_s,
        }

    def reserve_kv(self, transfer_id: str, prompt: Any, params: Any, wait_s: float) -> dict[str, Any]:
        """Push mode: reserve the blocks of the request that `prompt` and `params` will be,
        for the prefill leg to write within `wait_s`; returns where (a push target)."""
        return push_legs.reserve(self, transfer_id, prompt, params, wait_s)

    def release_push(self, transfer_id: str, writer_gone: bool = False) -> bool:
        """Push mode: the request will not come (its prefill failed or it left): give up its
        reservation (fenced from a late writer unless `writer_gone`)."""
        return self.pushes.abandon(transfer_id, "released", writer_gone=writer_gone)

    def _check(self, request: EngineRequest) -> None:
        kv_params = request.params.kv_transfer_params
        if not kv_params or not kv_params.get("do_remote_prefill"):
            return  # no remote KV: prefilled here
        if from_vllm(kv_params):  # an unmodified vLLM prefill engine's KV
            self._check_handoff_keys(request, kv_params, kv_params.get("transfer_id"))
            self._wait_s(request.request_id, kv_params)
            request.vllm_kv = self.vllm.accept(kv_params)
            return
        if RECORD_KEY in kv_params:  # pushed into blocks reserved here
            self._check_handoff_keys(request, kv_params, kv_params.get("transfer_id"))
            self._wait_s(request.request_id, kv_params)
            push_legs.take_pushed(self, request, kv_params)
            return
        descriptor = KVDescriptor.from_params(kv_params)
        if descriptor.num_tokens != request.prompt_len:
            raise ValueError(
                f"request {request.request_id}: transfer {descriptor.transfer_id} holds "
                f"KV for {descriptor.num_tokens} tokens but the prompt has "
                f"{request.prompt_len}"
            )
        self._check_handoff_keys(request, kv_params, descriptor.transfer_id)
        self._wait_s(request.request_id, kv_params)
        staging = self.receiver.staging_blocks(descriptor)
        needed = staging + self.kv.blocks_for(request.prompt_len)
        if staging and needed > self.kv.num_blocks:
            raise ValueError(
                f"request {request.request_id}: transfer {descriptor.transfer_id} "
                f"stages into {staging} KV blocks besides the request's own, "
                f"{needed} in all; stage {self.stage_id} has {self.kv.num_blocks}; "
                "raise engine_args.kv_pool_blocks"
            )
        request.kv = descriptor

    def _check_handoff_keys(
        self, request: EngineRequest, kv_params: dict[str, Any], transfer_id: Any
    ) -> None:
        for key in ("first_token", *self.runner.handoff_keys):
            if not _is_int(kv_params.get(key)):
                raise ValueError(
                    f"request {request.request_id}: kv_transfer_params[{key!r}] for "
                    f"transfer {transfer_id}: expected an int from the "
                    f"prefill stage, got {kv_params.get(key)!r:.80}"
                )

    def _wait_s(self, request_id: str, kv_params: dict[str, Any]) -> float:
        value = kv_params.get("kv_wait_s")
        if value is None:
            return self.kv_miss_window_s
        # 0 is a wait that has run out already (the orchestrator's deadline): a miss, unless
        # the KV is there by the first poll.
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise ValueError(
                f"request {request_id}: kv_transfer_params['kv_wait_s'] must be a "
                f"number of seconds >= 0, got {value!r:.80}"
            )
        return float(value)

    def _match_prefix(self, request: EngineRequest) -> list[int]:
        """For a prompt whose KV arrives from the prefill leg: the blocks of it this engine
        holds already (an earlier turn's), so that only the rest moves. Blocks are named here
        without their rows, which stay with the prefill leg, so a prompt this engine prefills
        itself (the fallback) does not reuse them."""
        if request.prefills_here or request.pushed or not self.prefix_caching:
            return []
        if request.vllm_kv is None and _remote_kv(request).kv_layout != self.layout:
            return []
        if _kv_params(request).get("kv_cacheable") is False:
            request.cacheable = False
            return []
        return self.kv.match(self._prompt_ids(request), request.extra_keys, limit=request.prompt_len)

    def _resume(self, request: EngineRequest) -> list[StepOutput]:
        kv_params = _kv_params(request)
        self.runner.resume(request, {key: int(kv_params[key]) for key in self.runner.handoff_keys})
        return self._first_token(request, int(kv_params["first_token"]))

    def _start(self, request: EngineRequest) -> list[StepOutput]:
        if request.pushed is not None:
            return push_legs.start_pushed(self, request)
        if request.prefills_here:
            log.debug(
                "request %s: no remote KV, prefilling %d prompt positions here",
                request.request_id,
                request.prompt_len,
            )
            return self._prefill_here(request)
        if request.vllm_kv is not None:
            return self._start_vllm(request)
        kv_params, remote = _kv_params(request), _remote_kv(request)
        self.peers.check(remote.remote_engine_id, kv_params.get(FINGERPRINT_KEY))
        reused = self._count_reused(request)
        request.reused = request.blocks[:reused]
        if reused == len(remote.remote_block_ids):  # the whole prompt is here
            request.reused = []  # they stay among the request's blocks
            return self._resume_cached(request)
        descriptor = remote.without_first(reused) if reused else remote
        # The prompt's blocks go to the receiver for the read and come back with the result;
        # the request keeps the blocks its output will fill.
        prompt_blocks = self.receiver.dest_blocks(descriptor)
        hops.stamp(request.metrics, "kv read started")
        self.receiver.start(
            descriptor,
            self._wait_s(request.request_id, kv_params),
            into=request.blocks[reused : reused + prompt_blocks],
        )
        request.blocks = request.blocks[reused + prompt_blocks :]
        self._enter_fetching(request)
        log.debug(
            "request %s: reading %d prompt positions of KV as transfer %s from %s",
            request.request_id,
            request.prompt_len,
            remote.transfer_id,
            remote.remote_session,
        )
        # A same-host copy is complete already: the first token leaves in this step.
        fetched = self.receiver.poll(remote.transfer_id)
        return self._fetched(request, fetched) if fetched is not None else []

    def _count_reused(self, request: EngineRequest) -> int:
        """The prompt's full blocks this engine's prefix cache holds: they stay, only the rest of
        the prompt moves (counted in the request's metrics)."""
        reused = request.cached_len // self.block_size
        request.cached_len = 0
        request.metrics.update(
            kv_reused_tokens=reused * self.block_size,
            kv_bytes_reused=reused * self.block_size * self.layout.bytes_per_token,
        )
        return reused

    def _resume_cached(self, request: EngineRequest) -> list[StepOutput]:
        """Nothing to move: the prefix cache holds the whole prompt."""
        request.metrics.update(kv_transfer_ms=0.0, kv_bytes_transferred=0, kv_path="cached")
        return self._resume(request)

    def _enter_fetching(self, request: EngineRequest) -> None:
        """The request waits for its KV (from a peer engine or a vLLM producer)."""
        request.phase = Phase.FETCHING
        self._last_fetch_start = time.perf_counter()
        hops.stamp(request.metrics, "kv read started", self._last_fetch_start)  # unless stamped before
        self.scheduler.fetching.append(request.request_id)

    def _leave_fetching(self, request: EngineRequest) -> None:
        """Its KV arrived: it runs."""
        self.scheduler.fetching.remove(request.request_id)
        request.phase = Phase.RUNNING
        hops.stamp(request.metrics, "kv landed")

    def _start_vllm(self, request: EngineRequest) -> list[StepOutput]:
        """Ask the vLLM producer for the prompt's blocks this engine lacks (the last ones)."""
        kv_params = _kv_params(request)
        reused = self._count_reused(request)  # they stay among the request's blocks
        total = self.kv.blocks_for(request.prompt_len)
        if reused == total:  # the whole prompt is here: the producer may free its copy now
            self.vllm.release_producer(kv_params, self._wait_s(request.request_id, kv_params))
            return self._resume_cached(request)
        request.vllm_pull = self.vllm.start(
            kv_params, total - reused, self._wait_s(request.request_id, kv_params)
        )
        self._enter_fetching(request)
        log.debug(
            "request %s: pulling %d of %d prompt blocks from vLLM engine %s (transfer %s)",
            request.request_id,
            total - reused,
            total,
            kv_params["remote_engine_id"],
            kv_params["transfer_id"],
        )
        return []

    def _vllm_fetched(self, request: EngineRequest) -> list[StepOutput]:
        pull, request.vllm_pull = request.vllm_pull, None
        self._leave_fetching(request)
        total = self.kv.blocks_for(request.prompt_len)  # the pull holds the last ones
        dests = request.blocks[total - len(pull.staging) : total]
        began = time.perf_counter()
        if self.vllm.fault_pending:  # a perturbed block corrupts this request alone, never the cache
            request.cacheable = False
        self.vllm.land(pull, self.kv.cache.data, dests)
        self._name_blocks(request)
        request.metrics.update(
            kv_transfer_ms=(time.perf_counter() - self._last_fetch_start) * 1e3,
            kv_translate_ms=(time.perf_counter() - began) * 1e3,
            kv_bytes_transferred=len(dests) * self.block_size * self.layout.bytes_per_token,
            kv_blocks_transferred=len(dests),
            kv_path="vllm-mooncake",
        )
        return self._resume(request)

    def _name_blocks(self, request: EngineRequest) -> None:
        """Name the prompt's full blocks, arrived or reused, for the next turn's handoff."""
        same_layout = request.vllm_kv is not None or _remote_kv(request).kv_layout == self.layout
        if self.prefix_caching and same_layout and request.cacheable:
            full = request.prompt_len // self.block_size
            self.kv.register(request.blocks[:full], self._prompt_ids(request), request.extra_keys)

    def _progress(self) -> list[StepOutput]:
        self.receiver.reclaim()
        outputs: list[StepOutput] = []
        for request in [self.scheduler.requests[r] for r in self.scheduler.fetching]:
            try:
                if request.vllm_kv is not None:
                    if self.vllm.poll(request.vllm_pull):
                        outputs.extend(self._vllm_fetched(request))
                    continue
                fetched = self.receiver.poll(_remote_kv(request).transfer_id)
                if fetched is not None:
                    outputs.extend(self._fetched(request, fetched))
            except Exception as exc:  # this request's transfer failed or timed out
                log.debug(
                    "stage %d: request %s: %s: %s", self.stage_id, request.request_id, type(exc).__name__, exc
                )
                outputs.append(self._fail(request, f"{type(exc).__name__}: {exc}"))
        return outputs

    def _fetched(self, request: EngineRequest, fetched) -> list[StepOutput]:
        self._leave_fetching(request)
        # The KV is in them already: the reused blocks, the arrived ones, then the output's.
        request.blocks = request.reused + fetched.blocks + request.blocks
        request.reused = []
        self._name_blocks(request)
        request.metrics.update(
            kv_transfer_ms=fetched.transfer_ms,
            kv_bytes_transferred=fetched.bytes_transferred,
            kv_path=fetched.path,
        )
        return self._resume(request)

    def _can_start(self, request: EngineRequest) -> bool:
        # Blocks in quarantine come back only when Mooncake ends their reads: wait. A read in
        # place needs only the request's own blocks; one whose layout differs stages too.
        if request.prefills_here or request.pushed is not None:
            return True
        if request.vllm_kv is not None:
            return self.kv.blocks_for(request.prompt_len) <= self.vllm.free_staging()
        staging = self.receiver.staging_blocks(_remote_kv(request))
        return staging == 0 or staging + self.kv.blocks_for(request.prompt_len) <= self.kv.num_free

    def _release(self, request: EngineRequest) -> None:
        if request.vllm_pull is not None:  # staging stays quarantined until the producer answers
            self.vllm.release(request.vllm_pull)
            request.vllm_pull = None
        elif request.vllm_kv is not None and request.phase is Phase.WAITING:
            # Left before it asked the vLLM producer: tell it to free its copy now.
            self.vllm.release_producer(_kv_params(request), 1.0)
        elif request.phase is Phase.FETCHING:
            # Mooncake may still write the prompt's blocks: the receiver quarantines them.
            self.receiver.abandon(_remote_kv(request).transfer_id, f"request {request.request_id} left")
        self.kv.free(request.reused)  # the cached blocks it held while the rest moved
        request.reused = []

    def step_delay_s(self) -> float:
        # Nothing decodes: every admitted request waits on its read, and a request still
        # waiting after a step could not be admitted (it waits for slots or blocks that only
        # the end of a read or quarantine frees). Stepping again at once would only spin.
        s = self.scheduler
        if not s.requests or s.running or s.prefilling:  # a prompt part-way goes on at once
            return 0.0
        young = time.perf_counter() - self._last_fetch_start < FETCH_FAST_WINDOW_S
        return FETCH_FAST_POLL_S if young else FETCH_POLL_S

    def housekeeping(self) -> None:
        self.receiver.reclaim()
        self.pushes.expire()

    def load(self) -> dict[str, int]:
        return {**super().load(), "kv_push_late_records": self.pushes.late_records}

    def _output(self, request: EngineRequest, reason: str) -> Any:
        output = super()._output(request, reason)
        if not request.prefills_here:
            output.num_cached_prompt_tokens = request.prompt_len  # its KV came from the prefill
        return output

    def debug_state_counts(self) -> dict[str, int]:
        return {
            **super().debug_state_counts(),
            **self.receiver.debug_state_counts(),
            **self.pushes.debug_state_counts(),
            **self.vllm.debug_state_counts(),
        }

    def _blocks_lent(self) -> int:
        return self.receiver.blocks_held + self.pushes.blocks_held

    def close(self) -> None:
        self.vllm.close()
        self.receiver.close()

    # ---- what push mode calls of this leg (push_legs.PushDecodeLeg) --------------------------
    def prompt_ids(self, request: EngineRequest) -> list[int]:
        return self._prompt_ids(request)

    def resume_request(self, request: EngineRequest) -> list[StepOutput]:
        return self._resume(request)
