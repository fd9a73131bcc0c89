"""The KV transport interface: what the P/D legs (pull and push) and the vLLM interop use to move
bytes between registered memory regions of two processes.

A transport registers local regions (`register` / `unregister`), names itself to peers by a
session (`session_id`: what a peer passes as `remote_session`), and moves groups of
(local address, remote address, length) segments, blocking (`read`, `write`) or submitted and
polled without blocking (`submit_read`, `submit_write` -> a `TransferHandle`). What it can do
is in its `limits`. `open_transport` (kv/transport/__init__.py) picks the implementation from
a leg's transfer settings: today Mooncake (`mooncake.MooncakeTransport`, tcp or rdma).

The same-host paths are not transports of this shape, and say so here rather than pretend: a
shared-memory pool (shm.py) or a GPU pool opened by CUDA IPC handle (cuda_ipc.py) is not
moved by address at all. The decode side opens the peer's whole region once (`PeerRegions`:
mapped read-only, or rebuilt from its IPC handle) and then copies tensor to tensor, block by
block, checksumming each block while it is hot in cache. A raw (address, address, length)
write into local memory would lose that, and on a GPU has no torch interface. So they sit
behind their own small interface, `PeerRegions` (same_host.py: `SharedMemoryPeers`,
`CudaIpcPeers`); the receiver picks between its transport and a same-host path per peer
(kv/handoff/receiver.py, `kv_same_host`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..errors import KVTransferError

Segment = tuple[int, int, int]  # (local_addr, remote_addr, length)


def coalesce(segments: Sequence[Segment]) -> list[Segment]:
    """Merge entries whose local and remote ranges both continue the previous entry."""
    return coalesce_groups(segments)[0]


def coalesce_groups(
    segments: Sequence[Segment], max_bytes: int | None = None
) -> tuple[list[Segment], list[list[int]]]:
    """Merge entries whose local and remote ranges both continue the previous entry, into
    entries of at most `max_bytes` (None: no bound; a longer input entry stays whole). Returns
    the entries and, per entry, the indices of the input segments it holds."""
    merged: list[list[int]] = []
    groups: list[list[int]] = []
    for index, (local, remote, length) in enumerate(segments):
        if length <= 0:
            continue
        last = merged[-1] if merged else None
        if (
            last is not None
            and last[0] + last[2] == local
            and last[1] + last[2] == remote
            and (max_bytes is None or last[2] + length <= max_bytes)
        ):
            last[2] += length
            groups[-1].append(index)
        else:
            merged.append([local, remote, length])
            groups.append([index])
    return [(a, b, c) for a, b, c in merged], groups


class ReadState(enum.Enum):
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransportLimits:
    """What a transport can do. `same_host_only`: its peers must run on this host.
    `device_memory`: it registers and moves GPU memory itself (else a GPU pool stages through
    pinned host memory). `max_entries`: the most segments one submission takes (None: no
    bound; Mooncake takes one batch per segment)."""

    same_host_only: bool
    device_memory: bool
    max_entries: int | None = None


class TransferHandle(Protocol):
    """One submitted read or write, polled without blocking."""

    remote_session: str
    num_segments: int
    nbytes: int
    write: bool
    error: str

    @property
    def settled(self) -> bool:
        """The transport writes no more local memory for it (ended, or never started)."""
        ...

    @property
    def failed(self) -> bool: ...

    def poll(self) -> ReadState: ...

    def take_landed(self) -> list[int]:
        """Indices of the segments that completed since the last call."""
        ...

    def withdraw(self) -> bool:
        """Take back a submission not started yet; True if it will never run."""
        ...


class KVTransport(Protocol):
    """Moves bytes between registered regions of this process and a peer's (see the module
    docstring)."""

    host: str  # the address it serves on
    protocol: str  # "tcp", "rdma", ...
    session_id: str  # how a peer names this transport (its `remote_session`)

    @property
    def limits(self) -> TransportLimits: ...

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...

    @property
    def registered_bytes(self) -> int: ...

    def read(self, remote_session: str, segments: Sequence[Segment]) -> int:
        """Pull remote bytes into local registered memory, blocking; returns entries sent."""
        ...

    def write(self, remote_session: str, segments: Sequence[Segment]) -> int:
        """Push local registered bytes into a peer's registered memory, blocking."""
        ...

    def submit_read(self, remote_session: str, segments: Sequence[Segment]) -> TransferHandle: ...

    def submit_write(self, remote_session: str, segments: Sequence[Segment]) -> TransferHandle: ...

    def read_failure(self, read: TransferHandle) -> KVTransferError:
        """The error to raise for a failed submitted read, saying what to check."""
        ...

    def probe(self, remote_session: str) -> bool: ...


class PeerRegions(Protocol):
    """A peer's published region opened in this process, for the same-host paths (shared
    memory, CUDA IPC): not a mover but a mapping (see the module docstring)."""

    path: str  # its name in kv_same_host and in a transfer's kv_path ("shm", "cuda_ipc")
    limits: TransportLimits

    def get(self, session: str, where: str, nbytes: int) -> torch.Tensor:
        """The peer's region as a uint8 tensor of at least `nbytes`; OSError when it cannot be
        opened from here."""
        ...

    def close(self) -> None: ...
