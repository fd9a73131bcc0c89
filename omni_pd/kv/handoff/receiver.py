"""The decode side of the handoff: `KVReceiver` pulls descriptors' KV into blocks of a
registered pool without blocking (or from a same-host peer's pool), verifying each block's
checksum as the entries covering it land (see the package docstring)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..checksum import checksums
from ..errors import KVIntegrityError, KVMissError, KVTransferError
from ..layout import BlockLayout, check_compatible, convert_blocks, unpack_blocks
from ..pool import BlockPool
from ..transport import KVTransport, PeerRegions, ReadState, Segment, coalesce_groups
from ..transport.same_host import same_host_paths
from ..transport.shm import host_id
from .descriptor import KVDescriptor
from .pools import SAME_HOST_CHOICES, registered_pool
from .state import Transfer, TransferState, _descriptor_of, _read_of

# The package's logger, named as the module was before the split: log lines read as they did
# (operators' filters; e2e/test_network_exposure.py reads the Mooncake engine's line).
log = logging.getLogger(__package__)

# Largest Mooncake entry a KV read is cut into: big enough that per-entry costs vanish (one
# entry per 16 MiB: 24 for a 4k-token prompt of the 30B thinker), small enough that the checksums
# of landed entries overlap the rest of the read.
MAX_ENTRY_BYTES = 16 * 2**20
_FETCH_POLL_S = 0.0005
# Pools closed while a read may still write them; kept until the process exits.
_KEPT_ALIVE: list[BlockPool] = []


@dataclass(frozen=True)
class FetchResult:
    """A finished read. `blocks`: the destination blocks, holding the prompt's KV in the
    receiver's layout, back in the caller's hands. `converted`: the layouts differed (staged,
    then converted into them) rather than read in place. `kv_canonical`: from `fetch` only, the
    KV as a tensor (its blocks are freed)."""

    blocks: list[int]
    bytes_transferred: int
    transfer_ms: float
    num_segments: int
    converted: bool = False
    kv_canonical: torch.Tensor | None = None
    path: str = "tcp"

    @property
    def kv(self) -> torch.Tensor | None:
        return self.kv_canonical


class KVReceiver:
    """Pulls descriptors' KV into blocks of a registered pool, without blocking: `start` submits
    the read into destination blocks the caller hands over, `poll` (called each engine step)
    hands them back verified (and converted, where the layouts differ) once the KV has arrived,
    None before, and raises when it failed or its wait ran out. A failed or abandoned transfer's
    blocks go back to the pool, except while Mooncake may still write them (`settled` is false):
    those stay quarantined until `reclaim` sees the read end.

    `pool`: the decode engine's paged cache pool (shared: the KV lands where it is used), or a
    block count for a pool of the receiver's own (tools and tests, through `fetch`)."""

    def __init__(
        self,
        layout: BlockLayout,
        pool: int | BlockPool,
        transport: KVTransport,
        clock: Callable[[], float] = time.monotonic,
        same_host: str = "auto",
        buffer_device: str | None = None,
        host_staging: bool | None = None,
    ):
        if same_host not in SAME_HOST_CHOICES:
            raise ValueError(f"kv_same_host must be one of {list(SAME_HOST_CHOICES)}, got {same_host!r}")
        self.layout, self.transport, self._clock, self.same_host = layout, transport, clock, same_host
        # The same-host paths: a peer's pool opened here (PeerRegions, kv/transport/base.py).
        self._same_host: dict[str, PeerRegions] = same_host_paths()
        self._paths_said: set[str] = set()  # peers whose path was logged
        # Mooncake's reads land in `landing`: the pool, or its host copy (then copied up).
        self.pool, self.landing = registered_pool(
            layout, pool, transport, "receiver", buffer_device, host_staging
        )
        self._transfers: dict[str, Transfer] = {}
        self._quarantine: list[Transfer] = []  # ended transfers whose read Mooncake still runs
        self._lock = threading.Lock()  # bookkeeping only; nothing here waits on the peer
        self._closed = False

    # ---- the non-blocking path ---------------------------------------------------------------
    def dest_blocks(self, descriptor: KVDescriptor) -> int:
        """Destination blocks a transfer of `descriptor` fills: its tokens in the local layout."""
        return self.layout.num_blocks_for(descriptor.num_tokens)

    def staging_blocks(self, descriptor: KVDescriptor) -> int:
        """Extra blocks a transfer of `descriptor` stages into: none when the layouts are equal
        (read in place), else the remote blocks back to back at the remote block stride."""
        remote = descriptor.kv_layout
        if remote == self.layout:
            return 0
        staged_bytes = remote.num_blocks_for(descriptor.num_tokens) * remote.block_bytes
        return -(-staged_bytes // self.layout.block_bytes)

    def can_start(self, descriptor: KVDescriptor) -> bool:
        with self._lock:
            return self.staging_blocks(descriptor) <= self.pool.num_free

    def start(
        self,
        descriptor: KVDescriptor,
        wait_s: float = math.inf,
        verify_checksums: bool = True,
        into: list[int] | None = None,
    ) -> None:
        """Submit the read of the descriptor's KV into the destination blocks `into` (allocated
        from this pool by the caller; `dest_blocks(descriptor)` of them). `wait_s` bounds how long
        `poll` waits for it. Raises only before it takes the blocks (bad arguments, no room to
        stage, closed): from then on they are the receiver's until `poll` hands them back, or it
        frees (or quarantines) them when the transfer fails or is abandoned."""
        tid = descriptor.transfer_id
        if not wait_s >= 0:
            raise ValueError(f"transfer {tid}: wait_s must be >= 0, got {wait_s!r}")
        remote = descriptor.kv_layout
        check_compatible(remote, self.layout)  # fail before moving any bytes
        if into is None or len(into) != self.dest_blocks(descriptor):
            raise ValueError(
                f"transfer {tid}: {descriptor.num_tokens} tokens need "
                f"{self.dest_blocks(descriptor)} destination blocks, got "
                f"{None if into is None else len(into)}"
            )
        path, peer_pool = self._same_host_pool(descriptor)
        transfer = self._begin(tid, list(into), self.staging_blocks(descriptor))
        transfer.descriptor, transfer.verify_checksums, transfer.wait_s = descriptor, verify_checksums, wait_s
        transfer.deadline = self._clock() + wait_s
        transfer.lengths = remote.transfer_lengths(descriptor.num_tokens)
        if peer_pool is not None:
            transfer.path = path
            try:
                self._copy_shared(transfer, peer_pool)
            except Exception as exc:  # noqa: BLE001 - the blocks are taken: poll reports it
                transfer.failure = exc
            return
        try:
            segments = self._segments(descriptor, transfer, transfer.lengths)
            if verify_checksums:
                transfer.unverified = set(range(len(transfer.lengths)))
            transfer.read = self.transport.submit_read(descriptor.remote_session, segments)
        except Exception as exc:  # noqa: BLE001 - the blocks are taken: poll reports it
            transfer.failure = exc

    def poll(self, transfer_id: str) -> FetchResult | None:
        """The fetched KV, or None while the read runs and its wait has not run out. Raises
        KVMissError past the wait, KVTransferError when Mooncake failed, KVIntegrityError on a
        checksum mismatch; the transfer is over after any of them (or a result)."""
        transfer = self._transfers[transfer_id]
        if transfer.failure is not None:
            self._end(transfer, TransferState.FAILED, transfer.failure)
            raise transfer.failure
        if transfer.path in ("shm", "cuda_ipc"):  # copied and verified by start
            result = FetchResult(
                list(transfer.dest),
                sum(transfer.lengths),
                (time.perf_counter() - transfer.started) * 1e3,
                0,
                path=transfer.path,
            )
            self._end(transfer, TransferState.DONE)
            return result
        read = _read_of(transfer)
        state = read.poll()
        try:
            self._verify_landed(transfer)
        except KVIntegrityError as exc:
            self._end(transfer, TransferState.FAILED, exc)
            raise
        if state is ReadState.IN_FLIGHT:
            if self._clock() < transfer.deadline:
                return None
            error: Exception = self._miss(transfer)
            self._end(transfer, TransferState.ABANDONED, error)
            raise error
        if state is ReadState.FAILED:
            error = self.transport.read_failure(read)
            self._end(transfer, TransferState.FAILED, error)
            raise error
        try:
            result = self._assemble(transfer)
        except BaseException as exc:
            self._end(transfer, TransferState.FAILED, exc)
            raise
        self._end(transfer, TransferState.DONE)
        return result

    def abandon(self, transfer_id: str, reason: str) -> None:
        """The request is gone (aborted): end its transfer; unknown ids are ignored."""
        transfer = self._transfers.get(transfer_id)
        if transfer is not None:
            if transfer.read is not None:
                transfer.read.poll()  # a read that just ended frees its blocks now, not later
            self._end(transfer, TransferState.ABANDONED, reason)

    def reclaim(self) -> int:
        """Free the staging blocks of quarantined reads Mooncake has finished; returns how many.
        Cheap (one status call per read): call it each step and in housekeeping."""
        with self._lock:
            if not self._quarantine:
                return 0
            still, freed = [], 0
            for transfer in self._quarantine:
                read = _read_of(transfer)  # quarantined: its read has not settled
                read.poll()
                if read.settled:
                    self.pool.free(transfer.block_ids)
                    freed += len(transfer.block_ids)
                    log.debug(
                        "transfer %s: %d quarantined KV blocks freed after %.1f s",
                        transfer.transfer_id,
                        len(transfer.block_ids),
                        time.perf_counter() - transfer.started,
                    )
                else:
                    still.append(transfer)
            self._quarantine = still
            return freed

    # ---- the blocking path (tools and tests) --------------------------------------------------
    def fetch(
        self, descriptor: KVDescriptor, verify_checksums: bool = True, wait_s: float = math.inf
    ) -> FetchResult:
        """start + poll until done, sleeping between polls (no spinning), into blocks allocated
        here; returns the KV as a tensor and frees the blocks. Does not acknowledge: the caller
        tells the sender (release) once the KV is safely in use."""
        with self._lock:
            blocks = self.pool.allocate(self.dest_blocks(descriptor))
        try:
            self.start(descriptor, wait_s, verify_checksums, into=blocks)
        except BaseException:
            with self._lock:
                self.pool.free(blocks)  # start raised before taking them
            raise
        while (result := self.poll(descriptor.transfer_id)) is None:
            time.sleep(_FETCH_POLL_S)
        try:
            kv = unpack_blocks(self.pool.gather(result.blocks), self.layout, descriptor.num_tokens)
        finally:
            with self._lock:
                self.pool.free(result.blocks)
        return dataclasses.replace(result, blocks=[], kv_canonical=kv)

    # ---- internals ---------------------------------------------------------------------------
    def _begin(self, transfer_id: str, dest: list[int], num_staging: int) -> Transfer:
        """Register the transfer; from here it holds `dest` (taken last: nothing here raises
        after it)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("KVReceiver is closed")
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id} is already being fetched")
            staging = self.pool.allocate(num_staging) if num_staging else []
            transfer = Transfer(
                transfer_id, dest + staging, TransferState.TRANSFERRING, dest=dest, staging=staging
            )
            self._transfers[transfer_id] = transfer
            return transfer

    def _end(self, transfer: Transfer, state: TransferState, reason: object = "") -> None:
        """Final state. Done: the destination blocks go back to the caller (with the result),
        the staging blocks to the pool. Otherwise all its blocks go back to the pool, or into
        quarantine while the read may still write them."""
        transfer.move(
            state, f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
        )
        if state is not TransferState.DONE:
            log.debug("transfer %s %s: %s", transfer.transfer_id, state.value, transfer.reason)
        if transfer.read is not None and state is not TransferState.DONE:
            transfer.read.withdraw()  # a read still queued for submission never runs
        with self._lock:
            del self._transfers[transfer.transfer_id]
            if state is TransferState.DONE:
                if transfer.staging:
                    self.pool.free(transfer.staging)
            elif transfer.read is None or transfer.read.settled:
                self.pool.free(transfer.block_ids)
            else:
                self._quarantine.append(transfer)

    def _miss(self, transfer: Transfer) -> KVMissError:
        d = _descriptor_of(transfer)
        return KVMissError(
            f"transfer {d.transfer_id}: the KV from prefill peer {d.remote_session} (engine "
            f"{d.remote_engine_id}) did not arrive within {transfer.wait_s:g} s (kv_wait_s, or the "
            "decode stage's kv_miss_window_s); check that the prefill worker is running and not "
            "stopped or overloaded, and that its Mooncake port is reachable from the decode "
            f"worker ({len(transfer.block_ids)} staging blocks stay out of use while Mooncake may "
            "still write them)"
        )

    def _same_host_pool(self, descriptor: KVDescriptor) -> tuple[str, torch.Tensor | None]:
        """The prefill peer's pool, mapped ("shm") or opened by CUDA IPC handle ("cuda_ipc"),
        when a same-host path applies; (path, None): read over Mooncake. The choice is logged
        once per peer."""
        if self.same_host == "off":
            return "tcp", None
        gpu = self.pool.device.type == "cuda"
        path = "cuda_ipc" if gpu and descriptor.cuda_ipc else "shm"
        why = None
        if not (descriptor.shm_path or descriptor.cuda_ipc):
            why = "its pool is not shared memory (its kv_same_host is 'off')"
        elif gpu and not descriptor.cuda_ipc:
            why = "its pool is in host memory and this engine's is on a GPU"
        elif not gpu and not descriptor.shm_path:
            why = "its pool is on a GPU and this engine's is in host memory"
        elif self.same_host not in ("auto", path):
            why = f"kv_same_host is {self.same_host!r} but the path between these pools is {path!r}"
        elif descriptor.host_id != host_id():
            why = "it runs on another host"
        elif descriptor.kv_layout != self.layout:
            why = "its block layout differs from this engine's (converted through staging)"
        else:
            highest = max(descriptor.remote_block_ids) + 1
            # The checks above leave a path only when the descriptor carries its handle.
            where = descriptor.cuda_ipc if path == "cuda_ipc" else descriptor.shm_path
            assert where is not None, f"transfer {descriptor.transfer_id}: no {path} handle"
            try:
                pool = self._same_host[path].get(
                    descriptor.remote_session, where, highest * descriptor.block_bytes
                )
            except OSError as exc:
                why = f"its pool cannot be {'opened' if path == 'cuda_ipc' else 'mapped'} from here ({exc})"
        peer = descriptor.remote_session
        if why is not None:
            if self.same_host != "auto":
                raise KVTransferError(
                    f"transfer {descriptor.transfer_id}: kv_same_host is {self.same_host!r} but "
                    f"the KV of prefill peer {peer} cannot move that way: {why}; run both stages "
                    "on one host as one user (host memory: shm; GPUs: cuda_ipc) with kv_same_host "
                    "not 'off' on the prefill stage, or set kv_same_host to 'auto'"
                )
            if peer not in self._paths_said:
                self._paths_said.add(peer)
                log.info(
                    "KV from prefill peer %s moves over Mooncake %s%s: %s",
                    peer,
                    self.transport.protocol,
                    "" if self.landing is self.pool else " through pinned host memory",
                    why,
                )
            return "tcp", None
        if peer not in self._paths_said:
            self._paths_said.add(peer)
            log.info(
                "KV from prefill peer %s moves %s (same host)",
                peer,
                "by CUDA IPC, device to device"
                if path == "cuda_ipc"
                else f"through shared memory ({descriptor.shm_path})",
            )
        return path, pool

    def _copy_shared(self, transfer: Transfer, peer_pool: torch.Tensor) -> None:
        """Copy each remote block's transferred bytes from the mapped peer pool into its
        destination block, checksumming it right after, while it is still in cache."""
        descriptor = _descriptor_of(transfer)
        bb = descriptor.block_bytes
        for j, (remote, length) in enumerate(zip(descriptor.remote_block_ids, transfer.lengths)):
            dest = self.pool.block_view(transfer.dest[j])[:length]
            dest.copy_(peer_pool[remote * bb : remote * bb + length])
            if transfer.verify_checksums:
                self._verify(descriptor, {j: dest}, transfer.lengths)
        transfer.unverified = set()

    def _staged(self, transfer: Transfer) -> torch.Tensor:
        """The staging blocks as the remote blocks landed there, back to back (a view)."""
        descriptor = _descriptor_of(transfer)
        remote = descriptor.kv_layout
        count = remote.num_blocks_for(descriptor.num_tokens)
        raw = self.landing.gather(transfer.staging).reshape(-1)[: count * remote.block_bytes]
        return raw.view(count, remote.block_bytes)

    def _verify_landed(self, transfer: Transfer) -> None:
        """Check the blocks whose entries have all landed (later entries may still fly)."""
        ready: list[int] = []
        for entry in _read_of(transfer).take_landed():
            for j in transfer.blocks_of_entry[entry] if 0 <= entry < len(transfer.blocks_of_entry) else ():
                transfer.unlanded[j] -= 1
                if transfer.unlanded[j] == 0 and j in transfer.unverified:
                    ready.append(j)
        if ready:
            self._verify_blocks(transfer, ready)

    def _staging_spans(self, transfer: Transfer, j: int, length: int) -> Iterator[tuple[int, int, int]]:
        """Where remote block j's first `length` bytes go in the staging blocks (staged offset
        j * remote block bytes, split at local block boundaries): (block id, offset within it,
        bytes), in order."""
        local_bb = self.layout.block_bytes
        offset, left = j * _descriptor_of(transfer).block_bytes, length
        while left:
            block, within = divmod(offset, local_bb)
            piece = min(left, local_bb - within)
            yield transfer.staging[block], within, piece
            offset, left = offset + piece, left - piece

    def _staged_block(self, transfer: Transfer, j: int) -> torch.Tensor:
        """Remote block j's transferred bytes where they landed in the staging blocks: a view
        when they lie in one staging block, else its pieces joined (that block's bytes only,
        never a gather of the whole staging area at every poll)."""
        pieces = [
            self.landing.block_view(block)[within : within + piece]
            for block, within, piece in self._staging_spans(transfer, j, transfer.lengths[j])
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _verify_blocks(self, transfer: Transfer, blocks: list[int]) -> None:
        views = {
            j: self._staged_block(transfer, j)
            if transfer.staging
            else self.landing.block_view(transfer.dest[j])
            for j in blocks
        }
        self._verify(_descriptor_of(transfer), views, transfer.lengths)
        transfer.unverified.difference_update(blocks)

    def _assemble(self, transfer: Transfer) -> FetchResult:
        descriptor = _descriptor_of(transfer)
        remote = descriptor.kv_layout
        lengths = transfer.lengths
        if transfer.unverified:  # the last entries' blocks, or all when nothing reported early
            self._verify_blocks(transfer, sorted(transfer.unverified))
        if transfer.staging:
            staged = self._staged(transfer)
            local_blocks = convert_blocks(staged, remote, self.layout, descriptor.num_tokens)
            for block, data in zip(transfer.dest, local_blocks):
                self.pool.block_view(block).copy_(data)
        elif self.landing is not self.pool:  # landed in the host copy: up to the GPU
            self.pool.copy_blocks_from(self.landing, transfer.dest)
        transfer_ms = (time.perf_counter() - transfer.started) * 1e3
        return FetchResult(
            list(transfer.dest),
            sum(lengths),
            transfer_ms,
            _read_of(transfer).num_segments,
            converted=bool(transfer.staging),
        )

    def _segments(self, descriptor: KVDescriptor, transfer: Transfer, lengths: list[int]) -> list[Segment]:
        """Equal layouts: remote block j's first lengths[j] bytes to destination block j.
        Otherwise to staged offset j*remote_block_bytes, split where a staged range crosses a
        local block boundary."""
        pieces: list[Segment] = []
        block_of_piece: list[int] = []
        if not transfer.staging:
            for j, length in enumerate(lengths):
                pieces.append(
                    (self.landing.block_address(transfer.dest[j]), descriptor.remote_address(j), length)
                )
                block_of_piece.append(j)
        else:
            for j, length in enumerate(lengths):
                remote_addr = descriptor.remote_address(j)
                for block, within, piece in self._staging_spans(transfer, j, length):
                    pieces.append((self.landing.block_address(block) + within, remote_addr, piece))
                    block_of_piece.append(j)
                    remote_addr += piece
        entries, groups = coalesce_groups(pieces, MAX_ENTRY_BYTES)
        transfer.blocks_of_entry = [sorted({block_of_piece[k] for k in group}) for group in groups]
        transfer.unlanded = [0] * len(lengths)
        for blocks in transfer.blocks_of_entry:
            for j in blocks:
                transfer.unlanded[j] += 1
        return entries

    @staticmethod
    def _verify(descriptor: KVDescriptor, blocks: dict[int, torch.Tensor], lengths: list[int]) -> None:
        order = list(blocks)
        sums = checksums([blocks[j][: lengths[j]] for j in order], descriptor.checksum_kind)
        for j, got in zip(order, sums):
            expected = descriptor.block_checksums[j]
            if got != expected:
                raise KVIntegrityError(
                    f"transfer {descriptor.transfer_id}: block {j} (remote block "
                    f"{descriptor.remote_block_ids[j]} on {descriptor.remote_session}) has checksum "
                    f"{got}, the sender published {expected}; the sender's memory changed after "
                    "publish (lease expired and blocks reused?) or the transfer corrupted it"
                )

    def debug_state_counts(self) -> dict[str, int]:
        """transfers / used_blocks: held for live requests (zero between requests);
        kv_quarantined_blocks: held for reads Mooncake has not ended (no request's state)."""
        with self._lock:
            return {
                "transfers": len(self._transfers),
                "used_blocks": sum(len(t.block_ids) for t in self._transfers.values()),
                "kv_quarantined_blocks": sum(len(t.block_ids) for t in self._quarantine),
            }

    @property
    def blocks_held(self) -> int:
        """Pool blocks the receiver holds now (live transfers and quarantine)."""
        with self._lock:
            return sum(len(t.block_ids) for t in (*self._transfers.values(), *self._quarantine))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._transfers or self._quarantine:
                log.warning(
                    "KVReceiver closed with %d transfers in flight and %d reads quarantined",
                    len(self._transfers),
                    len(self._quarantine),
                )
                # Mooncake may still write the pool (tcp does not check registration): never
                # hand its memory back to the allocator.
                _KEPT_ALIVE.append(self.landing)
            self._closed = True
            self.transport.unregister(self.landing.base_address)
            for peers in self._same_host.values():
                peers.close()
