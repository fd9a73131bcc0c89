"""The prefill side of the handoff: `KVSender` publishes blocks of a registered pool under
leases, held until the decode side acknowledges them or the lease expires."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import torch

from ... import faults
from ..layout import BlockLayout, check_canonical
from ..pool import BlockPool
from ..transport.shm import host_id
from ..transport import KVTransport
from .descriptor import KVDescriptor
from .pools import registered_pool
from .state import Lease, TransferState

# The package's logger, named as the module was before the split: log lines read as they did
# (operators' filters; e2e/test_network_exposure.py reads the Mooncake engine's line).
log = logging.getLogger(__package__)


class KVSender:
    """Publishes blocks of a registered pool under leases. `pool`: the prefill engine's paged
    cache pool (its blocks are published as they are, `publish_blocks`), or a block count for a
    pool of the sender's own (tools and tests, through `publish`, which copies a KV tensor in)."""

    def __init__(
        self,
        engine_id: str,
        layout: BlockLayout,
        pool: int | BlockPool,
        transport: KVTransport,
        lease_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        buffer_device: str | None = None,
        host_staging: bool | None = None,
        same_host: bool = True,
    ):
        """`buffer_device`, `host_staging`: see `registered_pool`. `same_host`: offer the
        same-host path (a shared host pool's mapping, a GPU pool's CUDA IPC handle)."""
        if lease_timeout_s <= 0:
            raise ValueError(f"kv_lease_timeout_s: expected a positive number, got {lease_timeout_s!r}")
        self.engine_id, self.layout, self.transport = engine_id, layout, transport
        self.lease_timeout_s, self._clock = lease_timeout_s, clock
        self.pool, self.landing = registered_pool(
            layout, pool, transport, "sender", buffer_device, host_staging
        )
        self._ipc = self.pool.cuda_ipc_handle if same_host and self.pool.device.type == "cuda" else None
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()  # publish / release / expire may come from different threads
        self._closed = False

    def publish(self, transfer_id: str, kv_canonical: torch.Tensor) -> KVDescriptor:
        """Copy the KV into pool blocks allocated here and publish them (tools and tests)."""
        check_canonical(kv_canonical, self.layout)
        num_tokens = int(kv_canonical.shape[3])
        with self._lock:
            self._check_new(transfer_id)
            block_ids = self.pool.allocate(self.layout.num_blocks_for(num_tokens))
            try:
                self.pool.write(block_ids, kv_canonical)
                return self._lease(transfer_id, block_ids, num_tokens)
            except BaseException:
                self.pool.free(block_ids)
                raise

    def publish_blocks(
        self, transfer_id: str, block_ids: list[int], num_tokens: int, checksums: Sequence[str] | None = None
    ) -> KVDescriptor:
        """Publish blocks of the pool as they are (the prefill engine's paged cache, holding
        `num_tokens` tokens of KV) and describe them for the decode side. `checksums`: the
        blocks' checksums, taken by the writer as it wrote each block (while it was in cache);
        None: computed here. Raises only before it takes the blocks; from its return the lease
        holds them, freed on release, expiry or close."""
        if len(block_ids) != self.layout.num_blocks_for(num_tokens):
            raise ValueError(
                f"transfer {transfer_id}: {num_tokens} tokens are "
                f"{self.layout.num_blocks_for(num_tokens)} blocks, got {len(block_ids)}"
            )
        if checksums is not None and len(checksums) != len(block_ids):
            raise ValueError(
                f"transfer {transfer_id}: {len(checksums)} checksums for {len(block_ids)} blocks"
            )
        with self._lock:
            self._check_new(transfer_id)
            return self._lease(transfer_id, list(block_ids), num_tokens, checksums)

    def _check_new(self, transfer_id: str) -> None:
        if self._closed:
            raise RuntimeError(f"KVSender {self.engine_id} is closed")
        if transfer_id in self._leases:
            raise ValueError(f"transfer {transfer_id} is already published by {self.engine_id}")

    def _lease(
        self, transfer_id: str, block_ids: list[int], num_tokens: int, checksums: Sequence[str] | None = None
    ) -> KVDescriptor:
        """Checksum the blocks' transferred bytes (unless given) and hold them under a lease
        (lock held)."""
        lengths = self.layout.transfer_lengths(num_tokens)
        fault = faults.take("kv.publish.flip")  # test-only (omni_pd/faults.py); None unless armed
        if fault is not None and not fault.get("after_checksum", False):
            checksums = None  # the fault's flip must come before the checksums: take them anew
        self._apply_fault(fault, transfer_id, block_ids, lengths, after_checksum=False)
        sums = (
            tuple(checksums)
            if checksums is not None
            else tuple(self.pool.block_checksums(block_ids, lengths))
        )
        self._apply_fault(fault, transfer_id, block_ids, lengths, after_checksum=True)
        if self.landing is not self.pool:  # Mooncake reads the host copy: bring it up to date
            self.landing.copy_blocks_from(self.pool, block_ids)
        descriptor = KVDescriptor(
            transfer_id=transfer_id,
            remote_engine_id=self.engine_id,
            remote_session=self.transport.session_id,
            remote_block_ids=tuple(block_ids),
            remote_base_address=self.landing.base_address,
            block_bytes=self.layout.block_bytes,
            num_tokens=num_tokens,
            kv_layout=self.layout,
            block_checksums=sums,
            shm_path=self.pool.shm_path,
            cuda_ipc=self._ipc,
            host_id=host_id() if self.pool.shm_path or self._ipc else None,
            checksum_kind=self.pool.checksum_kind,
        )
        self._leases[transfer_id] = Lease(
            transfer_id, block_ids, TransferState.PUBLISHED, deadline=self._clock() + self.lease_timeout_s
        )
        return descriptor

    def _apply_fault(
        self,
        fault: dict | None,
        transfer_id: str,
        block_ids: list[int],
        lengths: list[int],
        after_checksum: bool,
    ) -> None:
        """The armed kv.publish.flip fault hook, applied at its moment (test-only)."""
        if fault is None or fault.get("after_checksum", False) != after_checksum:
            return
        index, offset = fault["block_index"], fault["byte_offset"]
        if index >= len(block_ids) or offset >= lengths[index]:
            raise ValueError(
                f"injected fault (block {index}, byte {offset}) lies outside the "
                f"{len(block_ids)} blocks / transferred bytes of transfer {transfer_id}"
            )
        view = self.pool.block_view(block_ids[index])
        view[offset] ^= 0xFF
        log.warning(
            "transfer %s: injected a KV fault at block %d byte %d %s checksumming (test hook)",
            transfer_id,
            index,
            offset,
            "after" if after_checksum else "before",
        )

    def release(self, transfer_id: str) -> bool:
        """The decode side's acknowledgement: frees the lease's blocks."""
        with self._lock:
            lease = self._leases.pop(transfer_id, None)
            if lease is None:
                log.debug("release of unknown or already released transfer %s", transfer_id)
                return False
            lease.move(TransferState.DONE)
            self.pool.free(lease.block_ids)
        return True

    def expire_leases(self) -> list[str]:
        now = self._clock()
        expired: list[str] = []
        with self._lock:
            for transfer_id, lease in list(self._leases.items()):
                if lease.deadline <= now:
                    lease.move(TransferState.EXPIRED, "lease timeout")
                    del self._leases[transfer_id]
                    self.pool.free(lease.block_ids)
                    expired.append(transfer_id)
                    log.warning(
                        "transfer %s: lease expired after %.1f s without acknowledgement; freed %d KV blocks",
                        transfer_id,
                        self.lease_timeout_s,
                        len(lease.block_ids),
                    )
        return expired

    def debug_state_counts(self) -> dict[str, int]:
        with self._lock:
            return {"leases": len(self._leases), "used_blocks": self._held()}

    @property
    def blocks_held(self) -> int:
        """Pool blocks the leases hold now."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for lease in self._leases.values():
                self.pool.free(lease.block_ids)
            self._leases.clear()
            self.transport.unregister(self.landing.base_address)
