"""The per-transfer state machine both sides of the handoff report through, and their records:
a `Lease` (prefill side: PUBLISHED -> DONE | EXPIRED) and a `Transfer` (decode side:
TRANSFERRING -> DONE | FAILED | ABANDONED)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from ..transport import TransferHandle
from .descriptor import KVDescriptor


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
