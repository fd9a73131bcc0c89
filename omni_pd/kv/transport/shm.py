"""The same-host KV path: a decode process maps a prefill process's shared block pool.

A shared `BlockPool` is an anonymous shared-memory file of the prefill process
(``/proc/<pid>/fd/<fd>``). A decode process on the same host (same kernel boot id) and of the same
user opens that path and maps it read-only; the KV then moves with one memory copy instead of a
trip through Mooncake's tcp stack. Whether the path opens is the test: another host, another pid
namespace (a container), another user, or a prefill process that has exited all fail to open it,
and the receiver falls back to Mooncake (saying so once per peer).
"""

from __future__ import annotations

import functools
import mmap
import warnings
from collections import OrderedDict
from typing import Callable

import torch

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# Peers' pools kept mapped: a decode engine has one prefill peer, two across a peer's restart.
_MAX_MAPPED = 2


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This host's identity for the same-host check: the kernel's boot id ("" if unknown)."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def map_readonly(path: str) -> torch.Tensor:
    """A peer's shared pool file mapped read-only, as a uint8 tensor (which keeps the mapping
    alive while in use); raises OSError when it cannot be mapped from here."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only memory: the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


class PeerPools:
    """Peers' pools opened by `opener` (a shared file mapped: `map_readonly`; a GPU pool by
    CUDA IPC handle: `cuda_ipc.open_handle`), by (session, where); the least recently used is
    dropped past `_MAX_MAPPED` (a restarted peer has a new session)."""

    def __init__(self, opener: Callable[[str], torch.Tensor] = map_readonly) -> None:
        self._opener = opener
        self._maps: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()

    def get(self, session: str, where: str, nbytes: int) -> torch.Tensor:
        """The peer's pool as a uint8 tensor of at least `nbytes`; raises OSError when it cannot
        be opened from here."""
        key = (session, where)
        if key in self._maps:
            self._maps.move_to_end(key)
            return self._maps[key]
        view = self._opener(where)
        if view.numel() < nbytes:
            raise OSError(f"the peer's pool has {view.numel()} bytes, the descriptor needs {nbytes}")
        self._maps[key] = view
        while len(self._maps) > _MAX_MAPPED:
            self._maps.popitem(last=False)  # the tensor keeps its memory alive while in use
        return view

    def close(self) -> None:
        self._maps.clear()
