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


class PeerPools:
    """Read-only mappings of peers' shared pools, by (session, path); the least recently used
    is dropped past `_MAX_MAPPED` (a restarted peer has a new session)."""

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[str, str], tuple[mmap.mmap, torch.Tensor]] = OrderedDict()

    def get(self, session: str, path: str, nbytes: int) -> torch.Tensor:
        """The peer's pool as a uint8 tensor of at least `nbytes`; raises OSError when it cannot
        be mapped from here."""
        key = (session, path)
        if key in self._maps:
            self._maps.move_to_end(key)
            return self._maps[key][1]
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        if len(mapped) < nbytes:
            mapped.close()
            raise OSError(f"{path} maps {len(mapped)} bytes, the descriptor needs {nbytes}")
        with warnings.catch_warnings():  # read-only memory: the tensor is only ever read
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mapped, dtype=torch.uint8)
        self._maps[key] = (mapped, view)
        while len(self._maps) > _MAX_MAPPED:
            self._maps.popitem(last=False)  # the tensor keeps its mapping alive while in use
        return view

    def close(self) -> None:
        self._maps.clear()
