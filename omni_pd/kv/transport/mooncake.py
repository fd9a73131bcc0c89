"""One Mooncake TransferEngine (P2P handshake, no etcd) behind a small, raising interface.

Mooncake calls return codes and never raise; this wrapper turns failures into KVTransferError with
a message saying what to check. A read from a dead peer fails within milliseconds.

Two ways to read. `read` blocks in Mooncake's own wait loop, which spins a core, and on a frozen
peer lasts Mooncake's transfer timeout (``MC_TRANSFER_TIMEOUT``, 30 s, at least 5). `submit_read`
returns an `AsyncRead` at once; polling it costs microseconds and Mooncake's threads stay idle
meanwhile, so the caller bounds the wait itself. The submission itself runs on a thread of its
own: Mooncake's first call to a peer handshakes with it synchronously, and a frozen peer holds
that call (and, through Mooncake's lock, every other submission) about 60 s, whatever the
settings. An abandoned async read cannot be cancelled (the binding has no call for it): Mooncake
may still write its local memory until the read ends, which on a frozen peer happens after the
tcp transport's progress timeout (``MC_TCP_PROGRESS_TIMEOUT_SEC``, 30 s; ``MC_TRANSFER_TIMEOUT``
does not apply to async reads), or as soon as the peer resumes.

The listening sockets are restricted to the engine's host right after ``initialize()`` (see
socket_filter.py); ``OMNI_PD_KV_ANY_DESTINATION=1`` skips it.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import KVTransferError
from .base import ReadState, Segment, TransferHandle, TransportLimits, coalesce
from .proc_net import listening_sockets
from .socket_filter import ANY_DESTINATION_ENV, allowed_destinations, restrict_listeners

# The package's logger, named as the module was before the split: log lines read as they did
# (operators' filters; e2e/test_network_exposure.py reads the Mooncake engine's line).
log = logging.getLogger(__package__)

_INSTALL_HINT = (
    "install `mooncake-transfer-engine-non-cuda` (pip) and Debian `libibverbs1` "
    "(apt-get install libibverbs1), or run scripts/setup.sh"
)


def _load_engine_class():
    try:
        # Mooncake logs every start-up step (and "No RDMA devices found" on TCP) through glog;
        # keep its errors only, unless the deployer asked for more with MC_LOG_LEVEL.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(f"Mooncake's transfer engine cannot be imported ({exc}); {_INSTALL_HINT}") from exc
    return TransferEngine


def registers_device_memory() -> bool:
    """Whether the installed Mooncake transfer engine is a CUDA build, which registers GPU
    memory (`mooncake-transfer-engine`, `-cuda13`, ...), rather than the CPU-only
    `mooncake-transfer-engine-non-cuda`."""
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    builds = [n for n in names if n.startswith("mooncake-transfer-engine")]
    return any("non-cuda" not in n for n in builds)


_init_lock = threading.Lock()  # one initialize() at a time, so its new sockets are its own

LISTEN_WAIT_S = 2.0  # how long a new engine's listening sockets may take to appear


def _new_listeners(before: set[str], rpc_port: int) -> list[tuple[int, int]]:
    """(fd, port) of the listening sockets opened since `before` (their inodes: an fd number
    that another component closed meanwhile may come back as one of Mooncake's), once the
    handshake port is among them, polled up to LISTEN_WAIT_S; then whatever is there."""
    deadline = time.monotonic() + LISTEN_WAIT_S
    while True:
        listeners = sorted(v for inode, v in listening_sockets().items() if inode not in before)
        if rpc_port in {port for _, port in listeners} or time.monotonic() > deadline:
            return listeners
        time.sleep(0.005)  # polling for the sockets to appear, under the deadline


# transfer_check_status: 1 completed, -1 failed (Mooncake then frees the batch), 0 still
# running, -2 timed out (final, as Mooncake's own sync wait treats it).
_COMPLETED, _RUNNING = 1, 0


@dataclass(eq=False)
class AsyncRead:
    """One submitted read (or write: `write`), as one Mooncake batch per segment: the binding's non-blocking
    `transfer_check_status` reports only a batch's first task (its `get_batch_transfer_status`
    waits, spinning, until the batch ends)."""

    remote_session: str
    num_segments: int
    nbytes: int
    _engine: Any = field(repr=False)
    write: bool = False  # a push (local -> remote) rather than a read
    _pending: list[int] = field(default_factory=list)  # the submitter's until it is "submitted"
    _entry_of: dict[int, int] = field(default_factory=dict)  # batch id -> its entry's index
    _landed: list[int] = field(default_factory=list)  # entries completed since take_landed()
    error: str = ""  # why the read failed; empty while it has not
    _stage: str = "queued"  # -> "submitting" -> "submitted", or "queued" -> "withdrawn"
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def settled(self) -> bool:
        """Mooncake has finished every batch (or never got the read): it writes no more local
        memory."""
        return self._stage in ("submitted", "withdrawn") and not self._pending

    @property
    def failed(self) -> bool:
        return bool(self.error)

    def withdraw(self) -> bool:
        """Take back a read the submitter has not started; True if it will never run."""
        with self._lock:
            if self._stage == "queued":
                self._stage, self.error = "withdrawn", "withdrawn before submission"
            return self._stage == "withdrawn"

    def _begin_submit(self) -> bool:
        with self._lock:
            if self._stage != "queued":
                return False
            self._stage = "submitting"
            return True

    def _end_submit(self) -> None:
        with self._lock:
            self._stage = "submitted"

    def poll(self) -> ReadState:
        """Non-blocking. A batch that reached a final status is never polled again: Mooncake
        frees it then, and its id (an address) is reused by later batches."""
        if self._stage == "withdrawn":
            return ReadState.FAILED
        if self._stage != "submitted":
            return ReadState.IN_FLIGHT  # still being submitted (a first contact handshakes)
        still: list[int] = []
        for batch_id in self._pending:
            rc = self._engine.transfer_check_status(batch_id)
            if rc == _RUNNING:
                still.append(batch_id)
            elif rc == _COMPLETED:
                self._landed.append(self._entry_of.get(batch_id, -1))
            elif not self.error:
                self.error = f"Mooncake reported status {rc} for a batch"
        self._pending = still
        if self.error:
            return ReadState.FAILED
        return ReadState.IN_FLIGHT if still else ReadState.DONE

    def take_landed(self) -> list[int]:
        """Indices of the entries that completed since the last call (seen by `poll`): their
        bytes are in local memory while the others still fly."""
        landed, self._landed = self._landed, []
        return landed


def _valid_batch_id(batch_id: int) -> bool:
    # A failed submit returns 0, or -1 seen through an unsigned 64-bit batch id.
    return 0 < batch_id < 2**63


class _Submitter:
    """One daemon thread submitting reads in order (Mooncake serialises them under its lock
    anyway). Daemon: a handshake stuck on a frozen peer must not hold up process exit."""

    def __init__(self, engine: Any, name: str):
        self._engine = engine
        self._queue: queue.SimpleQueue[tuple[AsyncRead, list[Segment]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, read: AsyncRead, entries: list[Segment]) -> None:
        self._queue.put((read, entries))

    def _run(self) -> None:
        while True:
            read, entries = self._queue.get()
            if not read._begin_submit():
                continue  # withdrawn while queued
            try:
                self._submit(read, entries)
            except BaseException as exc:  # never leave a read half submitted and unsettled
                read.error = read.error or f"submitting the read raised {type(exc).__name__}: {exc}"
            finally:
                read._end_submit()

    def _submit(self, read: AsyncRead, entries: list[Segment]) -> None:
        call = (
            self._engine.batch_transfer_async_write if read.write else self._engine.batch_transfer_async_read
        )
        for index, (local, remote, length) in enumerate(entries):
            batch_id = call(read.remote_session, [local], [remote], [length])
            if not _valid_batch_id(batch_id):
                read.error = f"Mooncake refused to submit the {'write' if read.write else 'read'}"
                return
            read._entry_of[batch_id] = index
            read._pending.append(batch_id)


class MooncakeTransport:
    """The KV transport over Mooncake's TransferEngine (tcp, rdma): see the module docstring."""

    def __init__(
        self, host: str = "127.0.0.1", protocol: str = "tcp", progress_timeout_s: float | None = None
    ):
        """`progress_timeout_s`: how long Mooncake's tcp transport lets a read make no progress
        before failing it (it bounds how long an abandoned read keeps its memory); applied
        through MC_TCP_PROGRESS_TIMEOUT_SEC unless the deployer set that, and process-wide."""
        if progress_timeout_s is not None:
            os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(progress_timeout_s))))
        engine_class = _load_engine_class()
        self.host, self.protocol = host, protocol
        self._engine = engine_class()
        allowed = allowed_destinations(host)
        with _init_lock:
            before = set(listening_sockets())
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
            if rc != 0:
                raise KVTransferError(
                    f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}) "
                    f"returned {rc}; check that {host} is an address of this machine (kv_ip) and "
                    "that the protocol is available here ('tcp' always is; 'rdma' needs an RDMA "
                    "device)"
                )
            rpc_port = self._engine.get_rpc_port()
            self.listeners = _new_listeners(before, rpc_port)
            self.session_id = f"{host}:{rpc_port}"
            if allowed is not None:
                try:
                    if rpc_port not in {port for _, port in self.listeners}:
                        raise OSError(
                            f"its handshake port {rpc_port} is not among the sockets it "
                            f"opened ({self.listeners}; this process listens on "
                            f"{sorted(listening_sockets().values())})"
                        )
                    restrict_listeners(self.listeners, allowed)
                except OSError as exc:
                    raise KVTransferError(
                        f"cannot restrict Mooncake engine {self.session_id} to connections "
                        f"addressed to {host}: {exc}. Its ports would accept peers on every "
                        f"address of this machine; set {ANY_DESTINATION_ENV}=1 to accept that "
                        "(and firewall the ports)"
                    ) from exc
        log.info(
            "Mooncake engine %s listening on ports %s (%s), %s",
            self.session_id,
            ", ".join(str(port) for _, port in self.listeners),
            protocol,
            "accepting every destination address"
            if allowed is None
            else "accepting connections addressed to " + ", ".join(map(str, [*allowed[0], *allowed[1]])),
        )
        self._registered: dict[int, int] = {}
        self._submitter: _Submitter | None = None  # started with the first async read
        self._submitter_lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        if address in self._registered:
            raise ValueError(f"memory at {address:#x} is already registered")
        rc = self._engine.register_memory(address, nbytes)
        if rc != 0:
            raise KVTransferError(
                f"Mooncake register_memory({address:#x}, {nbytes}) returned {rc} "
                f"on {self.session_id}; check free memory and memlock limits"
            )
        self._registered[address] = nbytes

    def unregister(self, address: int) -> None:
        if address not in self._registered:
            raise ValueError(f"memory at {address:#x} is not registered with {self.session_id}")
        del self._registered[address]
        rc = self._engine.unregister_memory(address)
        if rc != 0:
            log.warning("Mooncake unregister_memory(%#x) returned %d on %s", address, rc, self.session_id)

    @property
    def limits(self) -> TransportLimits:
        """Across hosts; GPU memory where this Mooncake build registers it; no bound on a
        submission's segments (one Mooncake batch each)."""
        return TransportLimits(same_host_only=False, device_memory=registers_device_memory())

    @property
    def registered_bytes(self) -> int:
        return sum(self._registered.values())

    def read(self, remote_session: str, segments: Sequence[Segment]) -> int:
        """Pull remote bytes into local registered memory, blocking (see the module docstring);
        returns the number of entries sent. For benchmarks and tools: engines use submit_read."""
        return self._sync(
            self._engine.batch_transfer_sync_read,
            remote_session,
            segments,
            "read from",
            "prefill process is alive and its Mooncake port reachable from here, and that its lease "
            "has not expired (kv_lease_timeout_s) before the decode side fetched",
        )

    def write(self, remote_session: str, segments: Sequence[Segment]) -> int:
        """Push local registered bytes into a peer's registered memory, blocking (a vLLM
        consumer's blocks, kv/vllm/serve.py, from its own thread); returns the entries sent."""
        return self._sync(
            self._engine.batch_transfer_sync_write,
            remote_session,
            segments,
            "write to",
            "decode process is alive and its Mooncake port reachable from here",
        )

    def _sync(self, op, remote_session: str, segments: Sequence[Segment], what: str, check: str) -> int:
        entries = coalesce(segments)
        if not entries:
            return 0
        local, remote, lengths = (list(column) for column in zip(*entries))
        rc = op(remote_session, local, remote, lengths)
        if rc != 0:
            raise KVTransferError(
                f"KV {what} peer {remote_session} failed (Mooncake return code {rc}; "
                f"{len(entries)} segments, {sum(lengths)} bytes, {self.protocol}): check that the {check}"
            )
        return len(entries)

    def submit_read(self, remote_session: str, segments: Sequence[Segment]) -> AsyncRead:
        """Start pulling remote bytes into local registered memory, one Mooncake batch per entry
        of `segments` (as given: the caller coalesces, and `AsyncRead.take_landed` names
        entries by their index); never blocks on the peer. A refused submit (dead peer, bad
        address) shows as a failed read at the first poll; the batches submitted before it
        still count as in flight until they end."""
        entries = list(segments)
        read = AsyncRead(remote_session, len(entries), sum(e[2] for e in entries), self._engine)
        with self._submitter_lock:
            if self._submitter is None:
                self._submitter = _Submitter(self._engine, f"kv-submit-{self.session_id}")
        self._submitter.put(read, entries)
        return read

    def submit_write(self, remote_session: str, segments: Sequence[Segment]) -> AsyncRead:
        """Start pushing local registered bytes into a peer's registered memory, as
        `submit_read` reads (same queue, same polling; `AsyncRead.write` is set)."""
        entries = list(segments)
        write = AsyncRead(remote_session, len(entries), sum(e[2] for e in entries), self._engine, write=True)
        with self._submitter_lock:
            if self._submitter is None:
                self._submitter = _Submitter(self._engine, f"kv-submit-{self.session_id}")
        self._submitter.put(write, entries)
        return write

    def read_failure(self, read: TransferHandle) -> KVTransferError:
        return KVTransferError(
            f"KV read from peer {read.remote_session} failed ({read.error}; {read.num_segments} "
            f"segments, {read.nbytes} bytes, {self.protocol}): check that the prefill process is "
            "alive and its Mooncake port reachable from here, and that its lease has not expired "
            "(kv_lease_timeout_s) before the decode side fetched"
        )

    def probe(self, remote_session: str) -> bool:
        return self._engine.send_probe(remote_session) == 0
