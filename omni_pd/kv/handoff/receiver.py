"""The KV handoff: a prefill-side sender that publishes blocks under a lease, a decode-side receiver
that pulls them over Mooncake, and the per-transfer state machine both report through.

Prefill side: PUBLISHED -> DONE (decode side acknowledged) | EXPIRED (lease timed out).
Decode side:  TRANSFERRING -> DONE | FAILED | ABANDONED (the request stopped waiting: miss window
or abort).
Each side keeps its per-transfer objects in one dict, removed when the transfer reaches a final
state, so ``debug_state_counts()`` is all zeros between requests. One exception on the decode
side, counted apart: a transfer that ends while Mooncake may still write its blocks (a frozen
peer resumes late) leaves them in quarantine until Mooncake reports the read finished.

Zero copy on the decode side: when both sides share a block layout, the receiver reads each remote
block straight into a destination block of its pool, which is the decode engine's paged cache
(`KVReceiver(layout, cache.pool, ...)`); the engine hands the request's blocks over for the read
and gets them back, filled and verified, with the result. Only when the layouts differ does a
read land in staging blocks first, converted into the destination blocks in one pass.

Same host: when the prefill's pool is shared memory (`BlockPool(shared=True)`) and the decode
side can map it (`shm.PeerPools`: same host, same user, the prefill process alive), the receiver
copies each block straight out of the mapping into its destination block and checksums it while
it is hot in cache: one copy, no Mooncake. `same_host` chooses: "auto" (that when possible, else
Mooncake, said once per peer), "shm" (that or the transfer fails), "off" (Mooncake always).

GPU pools: a pool on a GPU is published as it is. On one host the decode side opens it by CUDA
IPC handle (`cuda_ipc`) and copies its blocks device to device, checksummed on the device
("wsum64", see checksum.py): same-host copies cannot corrupt, but the checksum also catches a
block the sender reused after its lease expired, which is why it is kept. Across hosts Mooncake
reads the GPU memory itself where its build registers device memory (a CUDA build); otherwise
each side stages through a pinned host copy of its pool (`kv_buffer_device: cpu`, the only way
with a CPU-only Mooncake): the sender copies the blocks it publishes to the host, the receiver
reads into its host copy and then copies the blocks to its GPU. Which path is in use is logged
once per engine and per peer.

Integrity without a second pass: a read is cut into Mooncake entries of at most
`MAX_ENTRY_BYTES` (adjacent blocks coalesce up to it), and each block's checksum is verified as
soon as the entries covering it have landed, at the poll that sees them, while later entries are
still on the wire; only the last entries' blocks are checked after the read ends.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .checksum import CHECKSUM_KINDS, checksum
from .cuda_ipc import open_handle
from .errors import KVIntegrityError, KVMissError, KVTransferError
from .layout import BlockLayout, check_canonical, check_compatible, convert_blocks, unpack_blocks
from .pool import BlockPool
from .shm import PeerPools, host_id
from .transport import KVTransport, PeerRegions, ReadState, Segment, TransferHandle, coalesce_groups

log = logging.getLogger(__name__)

SAME_HOST_CHOICES = ("auto", "shm", "cuda_ipc", "off")
BUFFER_DEVICE_CHOICES = (None, "cpu", "cuda")
# Largest Mooncake entry a KV read is cut into: big enough that per-entry costs vanish (one
# entry per 16 MiB: 24 for a 4k-token prompt of the 30B thinker), small enough that the checksums
# of landed entries overlap the rest of the read.
MAX_ENTRY_BYTES = 16 * 2**20


class TransferState(enum.Enum):
    PUBLISHED = "published"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    ABANDONED = "abandoned"


_LEGAL: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PUBLISHED: frozenset({TransferState.DONE, TransferState.EXPIRED}),
    TransferState.TRANSFERRING: frozenset(
        {TransferState.DONE, TransferState.FAILED, TransferState.ABANDONED}
    ),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.EXPIRED: frozenset(),
    TransferState.ABANDONED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class _Tracked:
    transfer_id: str
    block_ids: list[int]
    state: TransferState
    reason: str = ""

    def move(self, new: TransferState, reason: str = "") -> None:
        if new not in _LEGAL[self.state]:
            raise IllegalTransition(
                f"transfer {self.transfer_id}: illegal transition {self.state.name} -> {new.name}"
            )
        self.state, self.reason = new, reason


@dataclass
class Lease(_Tracked):
    """Prefill side: blocks held for the decode side until acknowledged or expired."""

    deadline: float = 0.0


@dataclass
class Transfer(_Tracked):
    """Decode side: one descriptor's bytes landing in blocks of the receiver's pool. `block_ids`
    are all the blocks it holds: `dest` (the KV's home, handed over by the caller) and, when the
    layouts differ, `staging`."""

    started: float = field(default_factory=time.perf_counter)
    descriptor: KVDescriptor | None = None
    read: TransferHandle | None = None
    deadline: float = math.inf  # on the receiver's clock
    wait_s: float = math.inf
    verify_checksums: bool = True
    dest: list[int] = field(default_factory=list)
    staging: list[int] = field(default_factory=list)
    failure: BaseException | None = None  # raised at the next poll (it happened after start took the blocks)
    path: str = "tcp"  # how the bytes move: Mooncake ("tcp", or its rdma), "shm" or "cuda_ipc"
    lengths: list[int] = field(default_factory=list)  # bytes moved per remote block
    blocks_of_entry: list[list[int]] = field(default_factory=list)  # remote block indices per entry
    unlanded: list[int] = field(default_factory=list)  # per remote block: its entries still in flight
    unverified: set[int] = field(default_factory=set)  # remote block indices not checked yet


def _descriptor_of(transfer: Transfer) -> KVDescriptor:
    """The descriptor `KVReceiver.start` gave the transfer (None only before that)."""
    assert transfer.descriptor is not None, f"transfer {transfer.transfer_id} was never started"
    return transfer.descriptor


def _read_of(transfer: Transfer) -> TransferHandle:
    """The Mooncake read `KVReceiver.start` submitted (None on a same-host path, or when the
    submission failed: then `failure` is set and nothing reaches the read)."""
    assert transfer.read is not None, f"transfer {transfer.transfer_id} has no Mooncake read"
    return transfer.read


# -- descriptor ------------------------------------------------------------------------------


def _need(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...], tid: str) -> Any:
    if key not in params:
        raise ValueError(f"kv_transfer_params for transfer {tid} is missing {key!r}")
    value = params[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(
            f"kv_transfer_params[{key!r}] for transfer {tid}: expected {names}, "
            f"got {type(value).__name__} {value!r:.80}"
        )
    return value


@dataclass(frozen=True)
class KVDescriptor:
    """Everything the decode side needs to pull one request's prompt KV."""

    transfer_id: str
    remote_engine_id: str
    remote_session: str
    remote_block_ids: tuple[int, ...]
    remote_base_address: int
    block_bytes: int
    num_tokens: int
    kv_layout: BlockLayout
    block_checksums: tuple[str, ...]
    # The same-host paths: where the prefill's shared pool can be mapped (host memory), or its
    # CUDA IPC handle (a GPU pool), and on which host.
    shm_path: str | None = None
    host_id: str | None = None
    cuda_ipc: str | None = None
    checksum_kind: str = "xxh3"  # how block_checksums were taken (checksum.py)

    KEYS = (
        "transfer_id",
        "remote_engine_id",
        "remote_session",
        "remote_block_ids",
        "remote_base_address",
        "block_bytes",
        "num_tokens",
        "kv_layout",
        "block_checksums",
    )
    OPTIONAL_KEYS = ("shm_path", "host_id", "cuda_ipc", "checksum_kind")

    def __post_init__(self) -> None:
        tid = self.transfer_id
        if self.num_tokens < 1 or self.remote_base_address <= 0 or self.block_bytes < 1:
            raise ValueError(
                f"transfer {tid}: num_tokens, remote_base_address and block_bytes "
                f"must be positive ({self.num_tokens}, {self.remote_base_address}, "
                f"{self.block_bytes})"
            )
        if self.block_bytes != self.kv_layout.block_bytes:
            raise ValueError(
                f"kv_transfer_params['block_bytes'] for transfer {tid}: {self.block_bytes} "
                f"disagrees with kv_layout ({self.kv_layout.block_bytes})"
            )
        expected = self.kv_layout.num_blocks_for(self.num_tokens)
        if len(self.remote_block_ids) != expected or len(self.block_checksums) != expected:
            raise ValueError(
                f"transfer {tid}: {self.num_tokens} tokens need {expected} blocks, got "
                f"{len(self.remote_block_ids)} remote_block_ids and "
                f"{len(self.block_checksums)} block_checksums"
            )
        if any(b < 0 for b in self.remote_block_ids):
            raise ValueError(f"kv_transfer_params['remote_block_ids'] for transfer {tid}: negative id")
        if self.checksum_kind not in CHECKSUM_KINDS:
            raise ValueError(
                f"kv_transfer_params['checksum_kind'] for transfer {tid}: expected one "
                f"of {list(CHECKSUM_KINDS)}, got {self.checksum_kind!r}"
            )

    def without_first(self, blocks: int) -> "KVDescriptor":
        """The same transfer less its first `blocks` blocks (the decode side holds them already:
        its prefix cache), so only the rest moves. Positions stay block-aligned."""
        if not 0 < blocks < len(self.remote_block_ids):
            raise ValueError(
                f"transfer {self.transfer_id}: cannot skip {blocks} of its "
                f"{len(self.remote_block_ids)} blocks"
            )
        return dataclasses.replace(
            self,
            remote_block_ids=self.remote_block_ids[blocks:],
            block_checksums=self.block_checksums[blocks:],
            num_tokens=self.num_tokens - blocks * self.kv_layout.block_size,
        )

    def remote_address(self, index: int) -> int:
        return self.remote_base_address + self.remote_block_ids[index] * self.block_bytes

    def to_params(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "remote_engine_id": self.remote_engine_id,
            "remote_session": self.remote_session,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_base_address": self.remote_base_address,
            "block_bytes": self.block_bytes,
            "num_tokens": self.num_tokens,
            "kv_layout": self.kv_layout.to_dict(),
            "block_checksums": list(self.block_checksums),
            **{key: getattr(self, key) for key in ("shm_path", "host_id", "cuda_ipc") if getattr(self, key)},
            **({"checksum_kind": self.checksum_kind} if self.checksum_kind != "xxh3" else {}),
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "KVDescriptor":
        """Read our keys out of kv_transfer_params; other (vLLM) keys are left alone."""
        if not isinstance(params, Mapping):
            raise ValueError(f"kv_transfer_params: expected a dict, got {type(params).__name__}")
        tid = _need(params, "transfer_id", str, "<unknown>")
        ids = _need(params, "remote_block_ids", (list, tuple), tid)
        sums = _need(params, "block_checksums", (list, tuple), tid)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
            raise ValueError(
                f"kv_transfer_params['remote_block_ids'] for transfer {tid}: expected a list of ints"
            )
        if not all(isinstance(s, str) for s in sums):
            raise ValueError(
                f"kv_transfer_params['block_checksums'] for transfer {tid}: expected a list of hex strings"
            )
        layout_dict = _need(params, "kv_layout", dict, tid)
        try:
            layout = BlockLayout.from_dict(layout_dict)
        except ValueError as exc:
            raise ValueError(f"kv_transfer_params['kv_layout'] for transfer {tid}: {exc}") from exc
        return cls(
            transfer_id=tid,
            remote_engine_id=_need(params, "remote_engine_id", str, tid),
            remote_session=_need(params, "remote_session", str, tid),
            remote_block_ids=tuple(ids),
            remote_base_address=_need(params, "remote_base_address", int, tid),
            block_bytes=_need(params, "block_bytes", int, tid),
            num_tokens=_need(params, "num_tokens", int, tid),
            kv_layout=layout,
            block_checksums=tuple(sums),
            **{key: _need(params, key, str, tid) for key in cls.OPTIONAL_KEYS if key in params},
        )


def _registered_pool(
    layout: BlockLayout,
    pool: int | BlockPool,
    transport: KVTransport,
    side: str,
    buffer_device: str | None = None,
    host_staging: bool | None = None,
) -> tuple[BlockPool, BlockPool]:
    """The engine's pool (its paged cache's), or a new one of `pool` blocks, and the memory
    Mooncake moves its bytes through, registered once: the pool itself, or a host copy of it.
    `host_staging` None decides: a GPU pool stages through pinned host memory when
    `buffer_device` is "cpu" or this Mooncake build cannot register GPU memory. True stages
    any pool (how the CPU tests run the staging path)."""
    if buffer_device not in BUFFER_DEVICE_CHOICES:
        raise ValueError(f"kv_buffer_device must be 'cpu', 'cuda' or unset, got {buffer_device!r}")
    if isinstance(pool, BlockPool):
        if pool.layout != layout:
            raise ValueError(f"the {side}'s pool has layout {pool.layout}, not {layout}")
    else:
        pool = BlockPool(layout, pool)
    landing = pool
    if pool.device.type != "cpu" and host_staging is None:
        direct = transport.limits.device_memory
        if buffer_device == "cuda" and not direct:
            raise KVTransferError(
                "kv_buffer_device is 'cuda' but this Mooncake build cannot register GPU memory "
                "(mooncake-transfer-engine-non-cuda); install a CUDA build of the transfer engine, "
                "or set kv_buffer_device to 'cpu' (or leave it unset) to stage through host memory"
            )
        host_staging = buffer_device == "cpu" or not direct
        log.info(
            "KV %s on %s: Mooncake moves it %s",
            side,
            pool.device,
            "through pinned host memory" if host_staging else "from GPU memory",
        )
    if host_staging:
        landing = BlockPool(layout, pool.num_blocks, pinned=pool.device.type == "cuda")
    transport.register(landing.base_address, landing.nbytes)
    return pool, landing


# -- prefill side ----------------------------------------------------------------------------


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
        """`buffer_device`, `host_staging`: see `_registered_pool`. `same_host`: offer the
        same-host path (a shared host pool's mapping, a GPU pool's CUDA IPC handle)."""
        if lease_timeout_s <= 0:
            raise ValueError(f"kv_lease_timeout_s: expected a positive number, got {lease_timeout_s!r}")
        self.engine_id, self.layout, self.transport = engine_id, layout, transport
        self.lease_timeout_s, self._clock = lease_timeout_s, clock
        self.pool, self.landing = _registered_pool(
            layout, pool, transport, "sender", buffer_device, host_staging
        )
        self._ipc = self.pool.cuda_ipc_handle if same_host and self.pool.device.type == "cuda" else None
        self._leases: dict[str, Lease] = {}
        self._fault: tuple[int, int, bool] | None = None
        self._lock = threading.Lock()  # publish / release / expire may come from different threads
        self._closed = False

    def inject_fault_once(self, block_index: int, byte_offset: int, after_checksum: bool = False) -> None:
        """Test hook: the next publish flips one byte, before checksumming (corruption the
        checksums cannot see) or after (as if the bytes changed on the way: the decode side must
        catch it)."""
        if block_index < 0 or byte_offset < 0:
            raise ValueError("inject_fault_once: block_index and byte_offset must be >= 0")
        with self._lock:
            self._fault = (block_index, byte_offset, after_checksum)

    def take_fault(self) -> tuple[int, int, bool] | None:
        """The pending test fault, now the caller's to apply (a push applies it instead)."""
        with self._lock:
            fault, self._fault = self._fault, None
            return fault

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
        if self._fault is not None and not self._fault[2]:
            checksums = None  # the test hook's flip must come before the checksums: take them anew
        self._apply_fault(transfer_id, block_ids, lengths, after_checksum=False)
        sums = (
            tuple(checksums)
            if checksums is not None
            else tuple(self.pool.block_checksum(b, n) for b, n in zip(block_ids, lengths))
        )
        self._apply_fault(transfer_id, block_ids, lengths, after_checksum=True)
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
        self, transfer_id: str, block_ids: list[int], lengths: list[int], after_checksum: bool
    ) -> None:
        if self._fault is None or self._fault[2] != after_checksum:
            return
        (index, offset, _), self._fault = self._fault, None
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


# -- decode side -----------------------------------------------------------------------------

# How often a blocking fetch() looks at its read: short next to a transfer, long next to a poll.
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
        self._peers: PeerRegions = PeerPools()
        self._peer_gpus: PeerRegions = PeerPools(open_handle)
        self._paths_said: set[str] = set()  # peers whose path was logged
        # Mooncake's reads land in `landing`: the pool, or its host copy (then copied up).
        self.pool, self.landing = _registered_pool(
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
                pool = (
                    self._peer_gpus.get(descriptor.remote_session, where, highest * descriptor.block_bytes)
                    if path == "cuda_ipc"
                    else self._peers.get(descriptor.remote_session, where, highest * descriptor.block_bytes)
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
        for j, view in blocks.items():
            expected = descriptor.block_checksums[j]
            got = checksum(view[: lengths[j]], descriptor.checksum_kind)
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
            self._peers.close()
            self._peer_gpus.close()
