"""The KV transport: one interface (`KVTransport`, base.py) and its implementations, chosen by
`open_transport` from a leg's transfer settings. `mooncake.py` is Mooncake's TransferEngine
(tcp, rdma); `socket_filter.py` restricts its listening sockets to the engine's host, reading
this process's sockets through `proc_net.py`. The same-host paths (`same_host.py`: shared
memory, `shm.py`; CUDA IPC, `cuda_ipc.py`) open a peer's pool instead (`PeerRegions`)."""

from __future__ import annotations

from .base import (
    KVTransport,
    PeerRegions,
    ReadState,
    Segment,
    TransferHandle,
    TransportLimits,
    coalesce,
    coalesce_groups,
)
from .mooncake import AsyncRead, MooncakeTransport, registers_device_memory


def open_transport(host: str, protocol: str, progress_timeout_s: float | None = None) -> KVTransport:
    """The transport a P/D leg moves its KV with: `host` (kv_ip), `protocol`
    (mooncake_protocol), `progress_timeout_s` (how long a read may make no progress; see
    MooncakeTransport). Mooncake serves every protocol it knows; it reports an unknown one."""
    return MooncakeTransport(host=host, protocol=protocol, progress_timeout_s=progress_timeout_s)


__all__ = [
    "AsyncRead",
    "KVTransport",
    "MooncakeTransport",
    "PeerRegions",
    "ReadState",
    "Segment",
    "TransferHandle",
    "TransportLimits",
    "coalesce",
    "coalesce_groups",
    "open_transport",
    "registers_device_memory",
]
