"""Push mode of the KV handoff: the decode side reserves a request's blocks and hands their
addresses to the prefill side (`PushTarget`), which writes each block over Mooncake as soon as
its positions are computed, then answers with a completion record (one checksum per decode
block); the decode side verifies the blocks in place and starts. Nothing is staged: each decode
block's token range is written straight into the decode layout, from however many prefill blocks
hold it (block sizes may differ when one divides the other). This needs token_major/fused blocks
of one dtype on both sides (each token's bytes contiguous); other layouts are refused by name.

Decode side (`PushReservations`): RESERVED -> DONE (the record arrived and checked out: the
blocks go to the request) | ABANDONED (its wait ran out, the orchestrator gave up, the record
failed its checks). An abandoned reservation whose writer may still be writing (a frozen prefill
worker that resumes) keeps its blocks fenced, out of use, for `fence_s` or until the writer is
known to be gone; a record that arrives for it is discarded and counted (`late_records`).

Prefill side (`KVPusher`): one `_Push` per transfer while the prefill runs, its writes submitted
chunk by chunk; `finish` waits for them within the target's wait and returns the checksums. A
push that ends while writes are in flight hands its source blocks to the pusher, which frees them
when Mooncake ends those writes; a write that lands after its wait ran out counts as late
(`late_writes`): the decode side has given up on it and discards it.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .. import faults
from .checksum import CHECKSUM_KINDS, checksum
from .errors import KVIncompatibleError, KVIntegrityError, KVMissError, KVTransferError
from .layout import BlockLayout
from .pool import BlockPool
from .transport import KVTransport, ReadState, Segment, TransferHandle, coalesce_groups

log = logging.getLogger(__name__)

TARGET_KEY = "kv_push_target"  # kv_transfer_params key: the decode side's reservation
RECORD_KEY = "kv_pushed"  # kv_transfer_params key: the prefill side's completion record
TRANSFER_MODES = ("push", "pull")
# How often `KVPusher.finish` looks at its writes: short next to a write, long next to a poll.
_FINISH_POLL_S = 0.0005
_MAX_ENTRY_BYTES = 16 * 2**20


def _need(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = params.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(
            f"kv_transfer_params[{TARGET_KEY!r}][{key!r}]: expected "
            f"{kind.__name__ if isinstance(kind, type) else '/'.join(k.__name__ for k in kind)}, "
            f"got {value!r:.80}"
        )
    return value


@dataclass(frozen=True)
class PushTarget:
    """Where the prefill side writes one request's prompt KV: decode blocks `block_ids` hold
    prompt positions `skip_tokens ..` (the ones before are in the decode side's prefix cache),
    each from its position block_size * k on; `wait_s`: how long the decode side waits."""

    transfer_id: str
    session: str
    base_address: int
    block_ids: tuple[int, ...]
    kv_layout: BlockLayout
    skip_tokens: int
    num_tokens: int
    wait_s: float
    checksum_kind: str = "xxh3"

    def __post_init__(self) -> None:
        size = self.kv_layout.block_size
        if self.skip_tokens % size or not 0 <= self.skip_tokens <= self.num_tokens:
            raise ValueError(
                f"push target {self.transfer_id}: skip_tokens {self.skip_tokens} must be a multiple "
                f"of the block size {size} within the {self.num_tokens} prompt positions"
            )
        expected = self.kv_layout.num_blocks_for(self.num_tokens) - self.skip_tokens // size
        if len(self.block_ids) != expected:
            raise ValueError(
                f"push target {self.transfer_id}: positions {self.skip_tokens}..{self.num_tokens} "
                f"need {expected} blocks, got {len(self.block_ids)}"
            )
        if self.checksum_kind not in CHECKSUM_KINDS or not self.wait_s >= 0:
            raise ValueError(f"push target {self.transfer_id}: bad checksum_kind or wait_s")

    def ranges(self) -> list[tuple[int, int]]:
        """Per target block, the prompt positions it holds."""
        size = self.kv_layout.block_size
        return [
            (start, min(start + size, self.num_tokens))
            for start in range(self.skip_tokens, self.num_tokens, size)
        ]

    def check_source(self, source: BlockLayout) -> None:
        """Raise KVIncompatibleError unless blocks in `source` can be written straight into
        this target's blocks."""
        target = self.kv_layout
        why = None
        if not source.same_geometry(target) or source.dtype != target.dtype:
            why = (
                f"the prefill's KV is {source.num_layers} layers x {source.num_kv_heads} heads x "
                f"{source.head_dim} ({source.dtype}), the decode side's {target.num_layers} x "
                f"{target.num_kv_heads} x {target.head_dim} ({target.dtype})"
            )
        elif any((lay.kv_split, lay.order) != ("fused", "token_major") for lay in (source, target)):
            why = "a push writes token ranges, which only fused token_major blocks keep contiguous"
        elif source.block_size % target.block_size and target.block_size % source.block_size:
            why = (
                f"block sizes {source.block_size} (prefill) and {target.block_size} (decode) do "
                "not divide one another"
            )
        if why is not None:
            raise KVIncompatibleError(
                f"transfer {self.transfer_id}: the prefill cannot write into the decode side's "
                f"blocks ({why}); set kv_connector_extra_config.transfer_mode: pull on the decode "
                "stage, or make the stages' KV layouts agree"
            )

    def to_params(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "session": self.session,
            "base_address": self.base_address,
            "block_ids": list(self.block_ids),
            "kv_layout": self.kv_layout.to_dict(),
            "skip_tokens": self.skip_tokens,
            "num_tokens": self.num_tokens,
            "wait_s": self.wait_s,
            "checksum_kind": self.checksum_kind,
        }

    @classmethod
    def from_params(cls, params: Any) -> "PushTarget":
        if not isinstance(params, Mapping):
            raise ValueError(f"kv_transfer_params[{TARGET_KEY!r}]: expected a dict, got {params!r:.80}")
        ids = _need(params, "block_ids", (list, tuple))
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise ValueError(f"kv_transfer_params[{TARGET_KEY!r}]['block_ids']: expected block ids")
        try:
            layout = BlockLayout.from_dict(_need(params, "kv_layout", dict))
        except ValueError as exc:
            raise ValueError(f"kv_transfer_params[{TARGET_KEY!r}]['kv_layout']: {exc}") from exc
        return cls(
            transfer_id=_need(params, "transfer_id", str),
            session=_need(params, "session", str),
            base_address=_need(params, "base_address", int),
            block_ids=tuple(ids),
            kv_layout=layout,
            skip_tokens=_need(params, "skip_tokens", int),
            num_tokens=_need(params, "num_tokens", int),
            wait_s=float(_need(params, "wait_s", (int, float))),
            checksum_kind=_need(params, "checksum_kind", str),
        )


def source_pieces(
    source: BlockLayout, blocks: Sequence[int], start: int, end: int
) -> Iterator[tuple[int, int, int]]:
    """Prompt positions start..end as they lie in source blocks `blocks` (the prompt's block
    table): (block id, byte offset within it, bytes), in order."""
    per_token = source.bytes_per_token
    while start < end:
        index, within = divmod(start, source.block_size)
        count = min(source.block_size - within, end - start)
        yield blocks[index], within * per_token, count * per_token
        start += count


# -- prefill side ------------------------------------------------------------------------------


class PushState(enum.Enum):
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"


@dataclass
class _Push:
    target: PushTarget
    source: list[int]  # the prompt's block table in the sender's pool
    deadline: float
    state: PushState = PushState.WRITING
    sent: int = 0  # target blocks submitted so far
    writes: list[TransferHandle] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # blocks kept while writes may still read them
    bytes: int = 0
    # The armed kv.publish.flip fault hook, taken at its start (test-only, omni_pd/faults.py):
    # a byte of a target block flipped in the source before its checksum (unseen) or after.
    fault: dict[str, Any] | None = None

    @property
    def settled(self) -> bool:
        return all(w.settled for w in self.writes)


class KVPusher:
    """Writes prompt KV from a registered pool (`pool`, Mooncake reads it from `landing`) into
    decode-side reservations. `free` gives blocks back to their owner (the engine's cache)."""

    def __init__(
        self,
        transport: KVTransport,
        pool: BlockPool,
        landing: BlockPool,
        free: Callable[[list[int]], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.transport, self.pool, self.landing, self._free, self._clock = (
            transport,
            pool,
            landing,
            free,
            clock,
        )
        self._pushes: dict[str, _Push] = {}
        self._fenced: list[_Push] = []  # ended with writes in flight: their source blocks held
        self.late_writes = 0  # writes that landed after their wait ran out (counter)
        self._lock = threading.Lock()

    def start(self, target: PushTarget, source: list[int]) -> None:
        target.check_source(self.pool.layout)
        with self._lock:
            if target.transfer_id in self._pushes:
                raise ValueError(f"transfer {target.transfer_id} is already being pushed")
            self._pushes[target.transfer_id] = _Push(
                target,
                list(source),
                deadline=self._clock() + target.wait_s,
                fault=faults.take("kv.publish.flip"),
            )

    def send(self, transfer_id: str, computed: int) -> None:
        """Submit the writes of every target block whose positions are all computed now (the
        first `computed` prompt positions are in the source blocks), with their checksums."""
        push = self._pushes[transfer_id]
        target = push.target
        ranges = target.ranges()
        ready = push.sent
        while ready < len(ranges) and ranges[ready][1] <= computed:
            ready += 1
        if ready == push.sent:
            return
        if self._clock() > push.deadline:
            raise self._late(push)
        dest_bytes = target.kv_layout.block_bytes
        segments: list[Segment] = []
        blocks = sorted({b for k in range(push.sent, ready) for b, _, _ in self._pieces(push, ranges[k])})
        if self.landing is not self.pool:  # Mooncake reads the host copy: bring it up to date
            self.landing.copy_blocks_from(self.pool, blocks)
        for k in range(push.sent, ready):
            pieces = list(self._pieces(push, ranges[k]))
            views = [self.pool.block_view(b)[off : off + n] for b, off, n in pieces]
            self._apply_fault(push, k, views, after_checksum=False)
            push.checksums.append(
                checksum(views[0] if len(views) == 1 else torch.cat(views), target.checksum_kind)
            )
            self._apply_fault(push, k, views, after_checksum=True)
            remote = target.base_address + target.block_ids[k] * dest_bytes
            for block, offset, length in pieces:
                segments.append((self.landing.block_address(block) + offset, remote, length))
                remote += length
        entries, _ = coalesce_groups(segments, _MAX_ENTRY_BYTES)
        push.writes.append(self.transport.submit_write(target.session, entries))
        push.bytes += sum(length for _, _, length in segments)
        push.sent = ready

    def _apply_fault(self, push: _Push, k: int, views: list[torch.Tensor], after_checksum: bool) -> None:
        fault = push.fault
        if fault is None or fault["block_index"] != k or fault.get("after_checksum", False) != after_checksum:
            return
        offset = fault["byte_offset"]
        for view in views:
            if offset < view.numel():
                view[offset] ^= 0xFF
                break
            offset -= view.numel()
        else:
            raise ValueError(f"injected fault {fault} lies outside pushed block {k}")
        push.fault = None
        log.warning(
            "transfer %s: injected a KV fault in pushed block %d (test hook)", push.target.transfer_id, k
        )
        if self.landing is not self.pool:
            self.landing.copy_blocks_from(self.pool, push.source)

    def _pieces(self, push: _Push, positions: tuple[int, int]) -> Iterator[tuple[int, int, int]]:
        return source_pieces(self.pool.layout, push.source, *positions)

    def finish(self, transfer_id: str) -> tuple[list[str], int]:
        """Wait (sleeping between polls, within the target's wait) until every write has landed;
        returns the checksums per target block and the bytes written. Raises KVTransferError when
        a write failed, KVMissError past the wait; the push is over after it (or a result)."""
        push = self._pushes[transfer_id]
        if push.sent != len(push.target.block_ids):
            raise ValueError(f"transfer {transfer_id}: {push.sent} of {len(push.target.block_ids)} sent")
        while True:
            states = [w.poll() for w in push.writes]
            failed = next((w for w, s in zip(push.writes, states) if s is ReadState.FAILED), None)
            if failed is not None:
                raise KVTransferError(
                    f"transfer {transfer_id}: writing the KV into decode peer {push.target.session} "
                    f"failed ({failed.error}); check that the decode worker is alive and its "
                    "Mooncake port reachable from here"
                )
            if all(s is ReadState.DONE for s in states):
                break
            if self._clock() > push.deadline:
                raise self._late(push)
            time.sleep(_FINISH_POLL_S)
        with self._lock:
            del self._pushes[transfer_id]
            push.state = PushState.DONE
        return push.checksums, push.bytes

    def _late(self, push: _Push) -> KVMissError:
        return KVMissError(
            f"transfer {push.target.transfer_id}: the KV was not written into decode peer "
            f"{push.target.session} within its wait of {push.target.wait_s:g} s (kv_miss_window_s "
            "of the decode stage); check that the decode worker is running and not overloaded"
        )

    def end(self, transfer_id: str, blocks: list[int]) -> bool:
        """The push failed or its request left: stop it. True when it took `blocks` (the
        request's) to hold while its writes may still read them; False: they stay the caller's."""
        with self._lock:
            push = self._pushes.pop(transfer_id, None)
            if push is None:
                return False
            push.state = PushState.FAILED
            for write in push.writes:
                write.withdraw()
                write.poll()
            if push.settled:
                return False
            push.held = list(blocks)
            self._fenced.append(push)
            return True

    def reclaim(self) -> int:
        """Free the blocks of ended pushes whose writes Mooncake has finished; a write that
        completed after its wait counts as late. Returns the blocks freed."""
        with self._lock:
            still, freed = [], 0
            for push in self._fenced:
                states = [w.poll() for w in push.writes]
                if push.settled:
                    if all(s is ReadState.DONE for s in states):
                        self.late_writes += 1
                        log.debug("transfer %s: late KV write landed; discarded", push.target.transfer_id)
                    self._free(push.held)
                    freed += len(push.held)
                else:
                    still.append(push)
            self._fenced = still
            return freed

    def debug_state_counts(self) -> dict[str, int]:
        with self._lock:
            return {"pushes": len(self._pushes), "push_fenced_blocks": self.blocks_held}

    @property
    def blocks_held(self) -> int:
        return sum(len(p.held) for p in self._fenced)


# -- decode side -------------------------------------------------------------------------------


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    DONE = "done"
    ABANDONED = "abandoned"


@dataclass
class Reservation:
    """A request's blocks, reserved for the prefill side to write: `blocks` is its whole block
    table (prompt, then output), `target` what the prefill side was told."""

    target: PushTarget
    blocks: list[int]
    deadline: float
    state: ReservationState = ReservationState.RESERVED
    fenced_until: float = 0.0


class PushReservations:
    """The decode side's reservations, by transfer id. `pool`: the engine's cache pool, written
    by Mooncake in `landing` (itself, or its registered host copy); `free` returns blocks to the
    engine's cache; `fence_s`: how long an abandoned reservation's blocks stay out of use while a
    late writer may still write them."""

    def __init__(
        self,
        session: str,
        pool: BlockPool,
        landing: BlockPool,
        free: Callable[[list[int]], None],
        fence_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.session, self.pool, self.landing, self._free = session, pool, landing, free
        self.fence_s, self._clock = fence_s, clock
        self._live: dict[str, Reservation] = {}
        self._fenced: dict[str, Reservation] = {}
        self.late_records = 0  # completion records for reservations already given up (counter)

    def reserve(
        self, transfer_id: str, blocks: list[int], skip_blocks: int, num_tokens: int, wait_s: float
    ) -> PushTarget:
        """Hold `blocks` (the request's block table, its first `skip_blocks` the prefix cache's)
        for the prefill side to write positions skip_blocks * block_size .. num_tokens into."""
        if transfer_id in self._live or transfer_id in self._fenced:
            raise ValueError(f"transfer {transfer_id} is already reserved")
        layout = self.pool.layout
        target = PushTarget(
            transfer_id=transfer_id,
            session=self.session,
            base_address=self.landing.base_address,
            block_ids=tuple(blocks[skip_blocks : layout.num_blocks_for(num_tokens)]),
            kv_layout=layout,
            skip_tokens=skip_blocks * layout.block_size,
            num_tokens=num_tokens,
            wait_s=wait_s,
            checksum_kind=self.pool.checksum_kind,
        )
        self._live[transfer_id] = Reservation(target, list(blocks), self._clock() + wait_s)
        return target

    def take(self, transfer_id: str, checksums: Sequence[str]) -> Reservation:
        """The completion record arrived: verify the written blocks and hand the reservation
        (its blocks) to the request. Raises KVMissError for a reservation given up already (the
        record is discarded and counted), KVIntegrityError on a mismatch (its blocks freed)."""
        reservation = self._live.pop(transfer_id, None)
        if reservation is None:
            if transfer_id in self._fenced:
                self.late_records += 1
            raise KVMissError(
                f"transfer {transfer_id}: the KV was pushed after this decode engine gave up on it "
                "(its wait ran out or the request left); the write is discarded, and the request "
                "falls back"
            )
        target = reservation.target
        try:
            if len(checksums) != len(target.block_ids):
                raise KVIntegrityError(
                    f"transfer {transfer_id}: {len(checksums)} checksums for {len(target.block_ids)} "
                    "pushed blocks"
                )
            lengths = [(end - start) * target.kv_layout.bytes_per_token for start, end in target.ranges()]
            for k, (block, length) in enumerate(zip(target.block_ids, lengths)):
                got = checksum(self.landing.block_view(block)[:length], target.checksum_kind)
                if got != checksums[k]:
                    raise KVIntegrityError(
                        f"transfer {transfer_id}: pushed block {k} (local block {block}) has checksum "
                        f"{got}, the prefill side wrote {checksums[k]}; the transfer corrupted it "
                        "or another writer touched the block"
                    )
        except KVIntegrityError:
            self._free(reservation.blocks)  # the writer is done (it sent the record)
            raise
        if self.landing is not self.pool:  # landed in the host copy: up to the GPU
            self.pool.copy_blocks_from(self.landing, list(target.block_ids))
        reservation.state = ReservationState.DONE
        return reservation

    def abandon(self, transfer_id: str, reason: str, writer_gone: bool = False) -> bool:
        """Give up on a reservation: its blocks are freed when the writer is known to be gone,
        else fenced for `fence_s`. False for an unknown transfer."""
        reservation = self._live.pop(transfer_id, None)
        if reservation is None:
            if writer_gone and transfer_id in self._fenced:
                self._free(self._fenced.pop(transfer_id).blocks)
                return True
            return False
        reservation.state = ReservationState.ABANDONED
        log.debug("push reservation %s abandoned: %s", transfer_id, reason)
        if writer_gone or not reservation.target.block_ids:
            self._free(reservation.blocks)
        else:
            reservation.fenced_until = self._clock() + self.fence_s
            self._fenced[transfer_id] = reservation
        return True

    def expire(self) -> None:
        """Give up on reservations past their wait; free fenced blocks past their fence."""
        now = self._clock()
        for transfer_id, reservation in list(self._live.items()):
            if reservation.deadline <= now:
                self.abandon(transfer_id, "its wait ran out before the completion record")
        for transfer_id, reservation in list(self._fenced.items()):
            if reservation.fenced_until <= now:
                del self._fenced[transfer_id]
                self._free(reservation.blocks)

    def debug_state_counts(self) -> dict[str, int]:
        """push_reservations: live (zero between requests); push_fenced_blocks: blocks kept from
        late writers (no request's state)."""
        return {
            "push_reservations": len(self._live),
            "push_fenced_blocks": len({b for r in self._fenced.values() for b in r.blocks}),
        }

    @property
    def blocks_held(self) -> int:
        """Distinct blocks held: reservations of one prompt share its prefix-cache blocks."""
        return len({b for r in (*self._live.values(), *self._fenced.values()) for b in r.blocks})

    @property
    def next_deadline(self) -> float:
        return min((r.deadline for r in self._live.values()), default=math.inf)
