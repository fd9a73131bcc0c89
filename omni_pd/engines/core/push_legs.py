"""Push mode of the P/D legs (kv/push.py has the protocol), as functions the legs call.

Decode leg: `reserve` holds a request's blocks before its prefill (its prefix cache's blocks
first, so only the rest is written), `take_pushed` hands them to the request when the prefill's
completion record arrives (verified in place), `start_pushed` starts it from the first token.
Prefill leg: `start_push` prefills the prompt in chunks (`prefill_in_chunks`), writing each
chunk's finished decode blocks while the next chunk computes, then waits for the writes and
answers with the completion record instead of publishing a lease.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from ... import faults
from ...kv.errors import PoolExhausted
from ...kv.fingerprint import FINGERPRINT_KEY, PeerFingerprints
from ...kv.layout import BlockLayout
from ...kv.push import RECORD_KEY, KVPusher, PushReservations, PushTarget
from ...kv.transport import KVTransport
from ..base import StepOutput
from .request import EngineRequest
from .runner import ArRunner, PrefillItem, Prefilled

if TYPE_CHECKING:
    from .kv_manager import KVManager


class PushDecodeLeg(Protocol):
    """What push mode reads and calls of the decode leg (pd_legs.DecodeEngine)."""

    @property
    def stage_id(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def prefix_caching(self) -> bool: ...
    @property
    def layout(self) -> BlockLayout: ...
    @property
    def runner(self) -> ArRunner: ...
    @property
    def kv(self) -> KVManager: ...
    @property
    def pushes(self) -> PushReservations: ...
    @property
    def peers(self) -> PeerFingerprints: ...

    def new_request(self, request_id: str, prompt: Any, params: Any) -> EngineRequest:
        """The runner's checked record of a request, its blocks' extra keys named."""
        ...

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        """The ids its prefix cache names the prompt's blocks by."""
        ...

    def resume_request(self, request: EngineRequest) -> list[StepOutput]:
        """Start a request whose prompt KV is in its blocks, from the prefill's first token."""
        ...


class PushPrefillLeg(Protocol):
    """What push mode reads and calls of the prefill leg (pd_legs.PrefillEngine)."""

    @property
    def block_size(self) -> int: ...
    @property
    def layout(self) -> BlockLayout: ...
    @property
    def runner(self) -> ArRunner: ...
    @property
    def kv(self) -> KVManager: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def fingerprint(self) -> dict[str, Any]: ...
    @property
    def transport(self) -> KVTransport: ...
    @property
    def pusher(self) -> KVPusher: ...
    @property
    def push_chunk_tokens(self) -> int: ...

    def prefill_prompt(self, request: EngineRequest) -> Prefilled:
        """Prefill the whole prompt (over its cached prefix) and sample the first token."""
        ...

    def compute_prefill(self, items: Sequence[PrefillItem]) -> list[Prefilled]:
        """One prefill pass of its runner through the engine's attention (ArEngine's)."""
        ...

    def take_first_token(self, request: EngineRequest, result: Prefilled, elapsed_ms: float) -> Prefilled: ...

    def cache_prompt(self, request: EngineRequest, pre: Prefilled, checksums: Sequence[str] = ()) -> None:
        """Name the prompt's blocks in its prefix cache (with their checksums)."""
        ...

    def prompt_checksums(self, request: EngineRequest) -> list[str]: ...

    def request_output(self, request: EngineRequest, reason: str) -> Any:
        """The finished request's output record, with the engine's metrics."""
        ...

    def drop_request(self, request: EngineRequest) -> None:
        """Forget a finished request (its blocks freed)."""
        ...


log = logging.getLogger(__name__)


# ---- decode leg ----------------------------------------------------------------------------


def reserve(engine: PushDecodeLeg, transfer_id: str, prompt: Any, params: Any, wait_s: float) -> dict:
    """Reserve the blocks of the request the decode leg will get as `prompt` (the prompt it is
    sent) with `params`: its prefix cache's blocks, then the rest of the prompt (its output's
    blocks come as it decodes). Returns the push target for the prefill leg (kv_transfer_params[TARGET_KEY])."""
    request = engine.new_request(transfer_id, prompt, params)
    matched: list[int] = []
    if engine.prefix_caching:
        matched = engine.kv.match(engine.prompt_ids(request), request.extra_keys, limit=request.prompt_len)
    positions = request.prompt_len + params.max_tokens
    if engine.kv.blocks_for(positions) > engine.kv.num_blocks:
        engine.kv.free(matched)
        raise ValueError(
            f"transfer {transfer_id}: prompt plus max_tokens need {engine.kv.blocks_for(positions)} "
            f"KV blocks, stage {engine.stage_id} has {engine.kv.num_blocks}; raise "
            "engine_args.kv_pool_blocks or lower max_tokens"
        )
    try:
        blocks = matched + engine.kv.allocate(request.prompt_len, have=len(matched))
    except PoolExhausted:
        engine.kv.free(matched)
        raise
    target = engine.pushes.reserve(transfer_id, blocks, len(matched), request.prompt_len, wait_s)
    log.debug(
        "transfer %s: reserved %d KV blocks (%d from the prefix cache) for a push",
        transfer_id,
        len(blocks),
        len(matched),
    )
    return target.to_params()


def take_pushed(engine: PushDecodeLeg, request: EngineRequest, kv_params: dict[str, Any]) -> None:
    """A decode request whose prompt KV was pushed: check the record, verify the blocks and make
    the reservation's blocks the request's (raises KV errors: the orchestrator falls back)."""
    transfer_id = kv_params.get("transfer_id")
    record = kv_params.get(RECORD_KEY)
    if not isinstance(transfer_id, str) or not isinstance(record, dict):
        raise ValueError(
            f"request {request.request_id}: kv_transfer_params[{RECORD_KEY!r}] needs a dict and "
            "a transfer_id (the prefill leg's completion record)"
        )
    try:
        engine.peers.check(kv_params.get("remote_engine_id", ""), kv_params.get(FINGERPRINT_KEY))
        if kv_params.get("num_tokens") != request.prompt_len:
            raise ValueError(
                f"request {request.request_id}: transfer {transfer_id} pushed KV for "
                f"{kv_params.get('num_tokens')} tokens but the prompt has {request.prompt_len}"
            )
    except BaseException:
        engine.pushes.abandon(transfer_id, "its record was refused", writer_gone=True)
        raise
    reservation = engine.pushes.take(transfer_id, list(record.get("checksums", [])))
    request.pushed, request.blocks = reservation, reservation.blocks
    request.metrics.update(
        kv_transfer_ms=float(record.get("transfer_ms", 0.0)),
        kv_bytes_transferred=int(record.get("bytes", 0)),
        kv_path="push",
        kv_reused_tokens=reservation.target.skip_tokens,
        kv_bytes_reused=reservation.target.skip_tokens * engine.layout.bytes_per_token,
    )


def start_pushed(engine: PushDecodeLeg, request: EngineRequest) -> list[StepOutput]:
    """Start a pushed request: its blocks hold the prompt's KV already."""
    if engine.prefix_caching and request.cacheable and _kv_params(request).get("kv_cacheable") is not False:
        full = request.prompt_len // engine.block_size
        engine.kv.register(request.blocks[:full], engine.prompt_ids(request), request.extra_keys)
    return engine.resume_request(request)


def _kv_params(request: EngineRequest) -> dict[str, Any]:
    return request.params.kv_transfer_params or {}


# ---- prefill leg ---------------------------------------------------------------------------


def check_target(engine: PushPrefillLeg, request: EngineRequest, params: Any) -> None:
    """Read the decode side's push target (refused when it cannot be written from here)."""
    target = PushTarget.from_params(params)
    if target.num_tokens != request.prompt_len:
        raise ValueError(
            f"request {request.request_id}: push target {target.transfer_id} is for "
            f"{target.num_tokens} tokens but the prompt has {request.prompt_len}"
        )
    target.check_source(engine.layout)
    request.push_target = target


def start_push(engine: PushPrefillLeg, request: EngineRequest) -> list[StepOutput]:
    target = request.push_target
    assert target is not None, f"request {request.request_id} has no push target"
    began = time.perf_counter()
    engine.pusher.start(target, request.blocks)

    def send(computed: int) -> None:
        engine.pusher.send(target.transfer_id, computed)
        if computed > request.cached_len:  # test-only (omni_pd/faults.py): nothing unless armed
            faults.hit("kv.push.chunk_sent", transfer_id=target.transfer_id)

    try:
        pre = prefill_in_chunks(engine, request, target, send)
        checksums, nbytes = engine.pusher.finish(target.transfer_id)
    except BaseException:
        if engine.pusher.end(target.transfer_id, request.blocks):
            request.blocks = []  # held until Mooncake ends the writes that read them
        raise
    transfer_ms = (time.perf_counter() - began) * 1e3
    engine.cache_prompt(request, pre, engine.prompt_checksums(request))
    assert pre.first_token is not None, "_take_first_token samples the first token"
    out_params = {
        "transfer_id": target.transfer_id,
        "num_tokens": request.prompt_len,
        RECORD_KEY: {"checksums": checksums, "bytes": nbytes, "transfer_ms": transfer_ms},
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine.engine_id,
        "remote_bootstrap_addr": f"mooncake://{engine.transport.session_id}",
        "remote_request_id": request.request_id,
        "first_token": pre.first_token,
        **{key: pre.state[key] for key in engine.runner.handoff_keys},
        FINGERPRINT_KEY: engine.fingerprint,
        "kv_cacheable": request.cacheable,
    }
    log.debug(
        "request %s: pushed %d prompt positions (%d bytes) as transfer %s",
        request.request_id,
        request.prompt_len - target.skip_tokens,
        nbytes,
        target.transfer_id,
    )
    engine.runner.prefilled(request, pre)
    request.tokens.append(pre.first_token)
    request.metrics.update(first_token_ms=request.elapsed_ms(), prefill_ms=pre.prefill_ms)
    output = engine.request_output(request, "length")
    output.kv_transfer_params = out_params
    engine.drop_request(request)  # no lease: the KV is in the decode side's blocks already
    return [StepOutput(request.request_id, finished=True, output=output)]


def chunk_tokens(engine: PushPrefillLeg, target: PushTarget) -> int:
    """kv_push_chunk_tokens rounded up to a multiple of both block sizes (chunks end on block
    boundaries of both sides)."""
    unit = max(engine.block_size, target.kv_layout.block_size)
    return -(-engine.push_chunk_tokens // unit) * unit


def prefill_in_chunks(
    engine: PushPrefillLeg, request: EngineRequest, target: PushTarget, send: Callable[[int], None]
) -> Prefilled:
    """Prefill the prompt into its blocks chunk by chunk, calling `send(n)` once the first n
    positions are in them; a runner without chunks (or a prompt its batched pass cannot take)
    prefills whole. The chunks' results are bit for bit the whole prompt's (each chunk attends
    to the KV of the ones before, as a prompt over a cached prefix does)."""
    if not (request.batchable and getattr(engine.runner, "prefills_in_chunks", False)):
        pre = engine.prefill_prompt(request)
        engine.kv.write(request.blocks, request.cached_len, pre.computed_kv)
        send(request.prompt_len)
        return pre
    began = time.perf_counter()
    step = chunk_tokens(engine, target)
    start = request.cached_len
    send(start)  # positions cached here already
    parts: list[Prefilled] = []
    while start < request.prompt_len:
        end = min(request.prompt_len, (start // step + 1) * step)
        [part] = engine.compute_prefill([PrefillItem(request, start, end)])
        engine.kv.write(request.blocks, start, part.computed_kv)
        send(end)
        parts.append(part)
        start = end
    last = parts[-1]
    whole = Prefilled(
        last.logits,
        torch.cat([p.computed_kv for p in parts], dim=3),
        {name: torch.cat([p.rows[name] for p in parts]) for name in last.rows},
        dict(last.state),
    )
    return engine.take_first_token(request, whole, (time.perf_counter() - began) * 1e3)
