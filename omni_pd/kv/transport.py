"""One Mooncake TransferEngine (P2P handshake, no etcd) behind a small, raising interface.

Mooncake calls return codes and never raise; this wrapper turns failures into KVTransferError with
a message saying what to check. A read from a dead peer fails within milliseconds; a frozen peer can
block up to Mooncake's transfer timeout (~30 s, ``MC_TRANSFER_TIMEOUT``). Deadlines longer than that
belong to the caller (the orchestrator), not here.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

from .errors import KVTransferError

log = logging.getLogger(__name__)

Segment = tuple[int, int, int]  # (local_addr, remote_addr, length)

_INSTALL_HINT = ("install `mooncake-transfer-engine-non-cuda` (pip) and Debian `libibverbs1` "
                 "(apt-get install libibverbs1), or run scripts/setup.sh")


def _load_engine_class():
    try:
        # Mooncake logs every start-up step (and "No RDMA devices found" on TCP) through glog;
        # keep its errors only, unless the deployer asked for more with MC_LOG_LEVEL.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(f"Mooncake's transfer engine cannot be imported ({exc}); {_INSTALL_HINT}") from exc
    return TransferEngine


def coalesce(segments: Sequence[Segment]) -> list[Segment]:
    """Merge entries whose local and remote ranges both continue the previous entry."""
    merged: list[list[int]] = []
    for local, remote, length in segments:
        if length <= 0:
            continue
        if merged and merged[-1][0] + merged[-1][2] == local and merged[-1][1] + merged[-1][2] == remote:
            merged[-1][2] += length
        else:
            merged.append([local, remote, length])
    return [(a, b, c) for a, b, c in merged]


class MooncakeTransport:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp"):
        engine_class = _load_engine_class()
        self.host, self.protocol = host, protocol
        self._engine = engine_class()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise KVTransferError(
                f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}) returned "
                f"{rc}; check that {host} is an address of this machine (kv_ip) and that the "
                f"protocol is available here ('tcp' always is; 'rdma' needs an RDMA device)")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}

    def register(self, address: int, nbytes: int) -> None:
        if address in self._registered:
            raise ValueError(f"memory at {address:#x} is already registered")
        rc = self._engine.register_memory(address, nbytes)
        if rc != 0:
            raise KVTransferError(f"Mooncake register_memory({address:#x}, {nbytes}) returned {rc} "
                                  f"on {self.session_id}; check free memory and memlock limits")
        self._registered[address] = nbytes

    def unregister(self, address: int) -> None:
        if address not in self._registered:
            raise ValueError(f"memory at {address:#x} is not registered with {self.session_id}")
        del self._registered[address]
        rc = self._engine.unregister_memory(address)
        if rc != 0:
            log.warning("Mooncake unregister_memory(%#x) returned %d on %s", address, rc, self.session_id)

    @property
    def registered_bytes(self) -> int:
        return sum(self._registered.values())

    def read(self, remote_session: str, segments: Sequence[Segment]) -> int:
        """Pull remote bytes into local registered memory; returns the number of entries sent."""
        entries = coalesce(segments)
        if not entries:
            return 0
        local, remote, lengths = (list(column) for column in zip(*entries))
        rc = self._engine.batch_transfer_sync_read(remote_session, local, remote, lengths)
        if rc != 0:
            raise KVTransferError(
                f"KV read from peer {remote_session} failed (Mooncake return code {rc}; "
                f"{len(entries)} segments, {sum(lengths)} bytes, {self.protocol}): check that the "
                "prefill process is alive and its Mooncake port reachable from here, and that its "
                "lease has not expired (kv_lease_timeout_s) before the decode side fetched")
        return len(entries)

    def probe(self, remote_session: str) -> bool:
        return self._engine.send_probe(remote_session) == 0
