"""The pool each side of the handoff registers with its transport once: the engine's own (its
paged cache's) or a new one, and the memory the transport moves its bytes through (the pool
itself, or a pinned host copy of a GPU pool)."""

from __future__ import annotations

import logging

from ..errors import KVTransferError
from ..layout import BlockLayout
from ..pool import BlockPool
from ..transport import KVTransport

# The package's logger, named as the module was before the split: log lines read as they did
# (operators' filters; e2e/test_network_exposure.py reads the Mooncake engine's line).
log = logging.getLogger(__package__)

SAME_HOST_CHOICES = ("auto", "shm", "cuda_ipc", "off")
BUFFER_DEVICE_CHOICES = (None, "cpu", "cuda")


def registered_pool(
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
