"""The producer half of vLLM 0.32's MooncakeConnector, for a prefill engine that is not vLLM.

An unmodified vLLM decode engine (`kv_role: kv_consumer`) given `do_remote_prefill`,
`remote_engine_id`, `remote_bootstrap_addr` and `transfer_id` in a request's kv_transfer_params
asks the producer's bootstrap server where its worker listens (kv/vllm/bootstrap.py), sends
that worker one msgpack `MooncakeXferMetadata` over a ZMQ DEALER socket (its Mooncake session,
per request its transfer id and destination block ids per KV group, per registered layer region
its base address, block stride, block length and layer index) and waits for the producer to
*write* the blocks into that memory, then for a `MooncakeXferResponse` (FINISH with ok_reqs /
err_reqs, or ERROR with a message). A consumer that holds a prefix already asks for fewer blocks
than the producer holds and gets the *last* ones (vLLM's partial prefix hit,
`MooncakeConnectorWorker._build_transfer_params`); asking for more is vLLM's "P num blocks less
than D" error; an empty list only releases the producer's blocks.

`VllmKVServer` is that producer for omni-pd's hf prefill engine. `offer` translates a request's
fused blocks into staging memory in vLLM's CPU layout (`translate_blocks_to_vllm`, byte checked),
registered once with the engine's Mooncake transport, and holds them under a lease keyed by the
transfer id: the engine's own blocks go back to it at once. The ZMQ ROUTER thread answers each
consumer: it checks the consumer's regions against the staging geometry (refused by name, both
values, in the ERROR message and the log), writes the blocks asked for, layer by layer, and frees
the staging. A lease nobody asks for expires after `lease_timeout_s`; `release` (the
orchestrator's, after the decode leg) frees it earlier. An offer is never freed while its write
runs. Per transfer: HELD -> SENDING -> SENT | FAILED, or HELD -> EXPIRED | RELEASED.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import KVTransferError
from ..transport import KVTransport, Segment
from .bootstrap import BootstrapServer
from .layout import VllmKVGeometry, translate_blocks_to_vllm
from .staging import VllmStaging

log = logging.getLogger(__name__)

_FINISH, _ERROR = 0, 2  # MooncakeXferResponseStatus (CONTINUE, 1, is never sent: one answer per ask)
_POLL_MS = 100  # how often the server thread looks at its stop flag and the leases between asks


class OfferState(enum.Enum):
    HELD = "held"
    SENDING = "sending"
    SENT = "sent"
    FAILED = "failed"
    EXPIRED = "expired"
    RELEASED = "released"


@dataclass
class VllmOffer:
    """One request's blocks, in staging, for the vLLM consumer that asks for its transfer id."""

    transfer_id: str
    staging: list[int]  # staging block ids, in the prompt's order
    deadline: float
    state: OfferState = OfferState.HELD  # SENDING: freed by the writer when its write ends
    refusal: str | None = None  # test hook (`offer(refuse=...)`): a consumer's ask gets this error


@dataclass(frozen=True)
class ConsumerRegions:
    """A consumer's registered layer regions, by this producer's layer index."""

    session: str
    base: tuple[int, ...]  # per layer of ours: the region's base address
    stride: tuple[int, ...]  # per layer: bytes from one block to the next


@dataclass
class ServeStats:
    """What the server moved (cumulative, for tests and benchmarks)."""

    sends: int = 0
    blocks_sent: int = 0
    refusals: list[str] = field(default_factory=list)


class ConsumerRefused(KVTransferError):
    """A vLLM consumer this producer cannot serve (its regions, parallelism or block count)."""


class VllmKVServer:
    def __init__(
        self,
        transport: KVTransport,
        geometry: VllmKVGeometry,
        staging_blocks: int,
        engine_id: str,
        lease_timeout_s: float,
        host: str = "127.0.0.1",
        clock: Callable[[], float] = time.monotonic,
    ):
        import msgspec  # vLLM's own dependencies: present wherever a vLLM consumer is
        import zmq

        if lease_timeout_s <= 0:
            raise ValueError(f"kv_lease_timeout_s: expected a positive number, got {lease_timeout_s!r}")
        self._msgpack, self._zmq = msgspec.msgpack, zmq
        self.transport, self.geometry, self.num_staging = transport, geometry, staging_blocks
        self.engine_id, self.lease_timeout_s, self._clock = engine_id, lease_timeout_s, clock
        self.staging = VllmStaging(transport, geometry, staging_blocks)
        self.layers = self.staging.layers
        self._offers: dict[str, VllmOffer] = {}
        self._lock = threading.Lock()
        self.stats = ServeStats()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.worker_addr = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="vllm-kv-serve", daemon=True)
        self._thread.start()
        self.bootstrap = BootstrapServer(host, engine_id, self.worker_addr)
        log.info(
            "vLLM consumers served as engine %s: bootstrap %s, side channel %s, %d staging blocks",
            engine_id,
            self.bootstrap.address,
            self.worker_addr,
            staging_blocks,
        )

    # ---- the engine's side --------------------------------------------------------------------
    def offer(
        self, transfer_id: str, fused: torch.Tensor, blocks: list[int], refuse: str | None = None
    ) -> VllmOffer:
        """Translate fused blocks `blocks` of `fused` (`[num_blocks, block_size, layers, 2, heads,
        head_dim]`) into staging and hold them for transfer `transfer_id`. From its return the
        caller's blocks are its own again. `refuse` (a test hook): answer the consumer's ask with
        this error, keeping the offer held (until released or expired)."""
        with self._lock:
            if transfer_id in self._offers:
                raise ValueError(f"transfer {transfer_id} is already offered by {self.engine_id}")
            staging = self.staging.take(
                len(blocks), "raise the prefill stage's kv_pool_blocks (or lower kv_lease_timeout_s)"
            )
        try:
            translate_blocks_to_vllm(fused, blocks, self.layers, staging)
        except BaseException:
            with self._lock:
                self.staging.give(staging)
            raise
        offer = VllmOffer(transfer_id, staging, self._clock() + self.lease_timeout_s, refusal=refuse)
        with self._lock:
            self._offers[transfer_id] = offer
        return offer

    def release(self, transfer_id: str) -> bool:
        """The decode leg is over: free the transfer's staging (after its write, if one runs)."""
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None:
                log.debug("release of unknown or already sent transfer %s", transfer_id)
                return False
            if offer.state is not OfferState.SENDING:  # else the writer frees it when done
                self._end(offer, OfferState.RELEASED)
            return True

    def expire(self) -> list[str]:
        """Free the offers no consumer asked for within the lease."""
        now, expired = self._clock(), []
        with self._lock:
            for offer in list(self._offers.values()):
                if offer.deadline > now or offer.state is OfferState.SENDING:
                    continue
                self._end(offer, OfferState.EXPIRED)
                expired.append(offer.transfer_id)
                log.warning(
                    "transfer %s: no vLLM consumer asked for it within %.1f s (kv_lease_timeout_s); "
                    "freed %d staging blocks",
                    offer.transfer_id,
                    self.lease_timeout_s,
                    len(offer.staging),
                )
        return expired

    def _end(self, offer: VllmOffer, state: OfferState) -> None:
        """Lock held: the offer reaches a final state and its staging is free."""
        offer.state = state
        if self._offers.get(offer.transfer_id) is offer:
            del self._offers[offer.transfer_id]
            self.staging.give(offer.staging)

    def debug_state_counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "kv.vllm_offers": len(self._offers),
                "kv.vllm_offer_blocks_held": self.staging.held,
            }

    # ---- the consumers' side ------------------------------------------------------------------
    def _serve(self) -> None:
        zmq = self._zmq
        while not self._stop.is_set():
            try:
                if self._socket.poll(_POLL_MS):
                    identity, payload = self._socket.recv_multipart()
                    answer = self.answer(payload)
                    self._socket.send_multipart([identity, self._msgpack.encode(answer)])
                self.expire()
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - one bad exchange must not end the server
                log.exception("the vLLM side channel of %s failed an exchange", self.engine_id)

    def answer(self, payload: bytes) -> dict[str, Any]:
        """One consumer's `MooncakeXferMetadata` in, its `MooncakeXferResponse` out (the blocks
        written before it returns)."""
        try:
            meta = self._msgpack.decode(payload)
            regions = self.regions_of(meta)
            asked = {str(d): (str(t), groups) for d, (t, groups) in meta["req_blocks"].items()}
        except (ConsumerRefused, KeyError, TypeError, ValueError) as exc:
            message = (
                exc.args[0] if isinstance(exc, ConsumerRefused) else f"bad MooncakeXferMetadata: {exc!r}"
            )
            log.warning("engine %s refused a vLLM consumer: %s", self.engine_id, message)
            self.stats.refusals.append(message)
            return {"status": _ERROR, "err_msg": message}
        ok: list[str] = []
        failed: list[str] = []
        messages: list[str] = []
        for d_req_id, (transfer_id, groups) in asked.items():
            try:
                self._send(transfer_id, groups, regions)
                ok.append(d_req_id)
            except KVTransferError as exc:
                log.warning("transfer %s for vLLM request %s: %s", transfer_id, d_req_id, exc)
                self.stats.refusals.append(str(exc))
                failed.append(d_req_id)
                messages.append(str(exc))
        answer: dict[str, Any] = {"status": _FINISH}
        if ok:
            answer["ok_reqs"] = ok
        if failed:
            answer["err_reqs"], answer["err_msg"] = failed, "; ".join(messages)
        return answer

    def regions_of(self, meta: dict[str, Any]) -> ConsumerRegions:
        """The consumer's layer regions, matched to this producer's layers by layer index and
        checked: one worker, one region per layer, blocks of this geometry's length."""
        geometry, wrong = self.geometry, []
        tp, pp = meta.get("remote_tp_size", 1), meta.get("remote_pp_size", 1)
        if (tp, pp) != (1, 1):
            wrong.append(f"parallelism: vLLM decode tensor/pipeline sizes ({tp}, {pp}), this producer (1, 1)")
        bases, strides, lengths = meta["kv_caches_base_addr"], meta["block_lens"], meta["kv_block_lens"]
        indices = list(meta.get("registered_layer_indices") or range(len(bases)))
        if not len(bases) == len(strides) == len(lengths) == len(indices):
            raise ConsumerRefused(
                f"MooncakeXferMetadata lists {len(bases)} base addresses, {len(strides)} block_lens, "
                f"{len(lengths)} kv_block_lens and {len(indices)} layer indices"
            )
        if sorted(indices) != list(range(geometry.num_layers)):
            wrong.append(
                f"layers: vLLM decode registered layer indices {sorted(indices)}, this producer "
                f"0..{geometry.num_layers - 1}"
            )
        odd = sorted({n for n in lengths if n != geometry.block_bytes})
        if odd:
            wrong.append(
                f"block bytes per layer: vLLM decode {odd}, this producer {geometry.block_bytes} "
                f"(block size {geometry.block_size}, {geometry.num_kv_heads} KV heads, head size "
                f"{geometry.head_size}, {geometry.dtype})"
            )
        if any(s < n for s, n in zip(strides, lengths)):
            wrong.append(f"block strides {strides} shorter than block lengths {lengths}")
        if wrong:
            raise ConsumerRefused(
                f"the hf prefill engine {self.engine_id} cannot write into this vLLM decode engine's "
                "KV cache: " + "; ".join(wrong) + ": give both engines the same model, dtype and block "
                "size (vLLM's block_size, the hf stage's kv_block_size), tensor and pipeline size 1"
            )
        by_layer = {int(index): r for r, index in enumerate(indices)}
        order = [by_layer[i] for i in range(geometry.num_layers)]
        return ConsumerRegions(
            session=f"{meta['remote_hostname']}:{meta['remote_port']}",
            base=tuple(int(bases[r]) for r in order),
            stride=tuple(int(strides[r]) for r in order),
        )

    def _send(self, transfer_id: str, groups: Any, regions: ConsumerRegions) -> None:
        """Write the last blocks of `transfer_id` into the consumer's blocks `groups[0]`."""
        if not isinstance(groups, (list, tuple)) or len(groups) > 1:
            raise ConsumerRefused(
                f"the vLLM decode engine asks for {len(groups) if isinstance(groups, (list, tuple)) else groups!r} "
                "KV cache groups; this producer holds one (full attention)"
            )
        remote = [int(b) for b in groups[0]] if groups else []
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None or offer.state is not OfferState.HELD:
                raise KVTransferError(
                    f"transfer {transfer_id} is not held by {self.engine_id} (its lease of "
                    f"{self.lease_timeout_s:g} s expired, it was released or sent, or it was never "
                    "published)"
                )
            if offer.refusal is not None:
                raise KVTransferError(f"transfer {transfer_id}: {offer.refusal}")
            if len(remote) > len(offer.staging):
                raise ConsumerRefused(
                    f"transfer {transfer_id}: the vLLM decode engine asks for {len(remote)} blocks, "
                    f"this producer holds {len(offer.staging)} (P num blocks less than D)"
                )
            offer.state = OfferState.SENDING
        final = OfferState.FAILED
        try:
            local = offer.staging[len(offer.staging) - len(remote) :]  # the last ones: a partial hit
            self.transport.write(regions.session, self._segments(local, remote, regions))
            final = OfferState.SENT
            self.stats.sends += 1
            self.stats.blocks_sent += len(remote)
            log.debug("transfer %s: wrote %d blocks to %s", transfer_id, len(remote), regions.session)
        finally:
            with self._lock:
                self._end(offer, final)

    def _segments(self, local: list[int], remote: list[int], regions: ConsumerRegions) -> list[Segment]:
        size = self.geometry.block_bytes
        return [
            (
                self.staging.address(layer, ours),
                regions.base[layer] + theirs * regions.stride[layer],
                size,
            )
            for layer in range(self.geometry.num_layers)
            for ours, theirs in zip(local, remote)
        ]

    # ---- end ----------------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.bootstrap.close()
        self._socket.close(0)
        self._context.term()
        with self._lock:
            self._offers.clear()
            self.staging.reset()
        self.staging.close()
