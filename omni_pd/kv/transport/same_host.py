"""The same-host paths behind the `PeerRegions` interface (base.py says why they are not
`KVTransport`s): a peer's shared host pool mapped read-only (`SharedMemoryPeers`, shm.py), or
its GPU pool opened by CUDA IPC handle (`CudaIpcPeers`, cuda_ipc.py). The sender side of each is
the pool itself: `BlockPool(shared=True)` publishes its `shm_path`, a GPU pool its
`cuda_ipc_handle`; `shm.host_id` tells the decode side whether it runs on the same host."""

from __future__ import annotations

from .base import PeerRegions, TransportLimits
from .cuda_ipc import open_handle
from .shm import PeerPools, map_readonly


class SharedMemoryPeers(PeerPools):
    """Peers' shared host pools, mapped read-only."""

    path = "shm"
    limits = TransportLimits(same_host_only=True, device_memory=False)

    def __init__(self) -> None:
        super().__init__(map_readonly)


class CudaIpcPeers(PeerPools):
    """Peers' GPU pools, opened by CUDA IPC handle."""

    path = "cuda_ipc"
    limits = TransportLimits(same_host_only=True, device_memory=True)

    def __init__(self) -> None:
        super().__init__(open_handle)


def same_host_paths() -> dict[str, PeerRegions]:
    """One of each same-host path, by its name (kv_same_host's "shm", "cuda_ipc")."""
    return {"shm": SharedMemoryPeers(), "cuda_ipc": CudaIpcPeers()}
