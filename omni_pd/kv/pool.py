"""A fixed pool of KV blocks in one contiguous, 64-byte-aligned host buffer.

One buffer means one Mooncake registration, and block i lives at ``base_address + i*block_bytes``,
so a descriptor needs only the base address and block ids. Allocation prefers the lowest-addressed
run of consecutive free blocks, so a request's blocks are usually adjacent and its transfer
coalesces into one segment.

Blocks are reference counted: `allocate` hands out blocks held once, `hold` adds a holder (two
requests that share a cached prompt prefix, a published lease), `free` lets go of one, and a
block is free again when its last holder lets go. A `keeper` (the hf engines' prefix cache) may
keep a block nobody holds instead: it then stays out of the free list, counts as available, and
is given up (evicted) when an allocation finds too few free blocks.

A `shared` pool lives in an anonymous shared-memory file (`memfd_create`) that another process of
the same user on the same host maps through ``/proc/<pid>/fd/<fd>`` (`shm_path`): the same-host
KV path. It has no name in /dev/shm, so nothing is left behind when the process dies.

A pool on a GPU (`device="cuda:N"`) is one device allocation; its same-host path is CUDA IPC
(`cuda_ipc_handle`), and its blocks are checksummed on the device (`checksum_kind`). A `pinned`
host pool is page-locked, for copies to and from a GPU (the host staging of a GPU pool).
"""

from __future__ import annotations

import mmap
import os
from typing import Iterable, Protocol, Sequence

import numpy as np
import torch

from .checksum import checksum, checksums, kind_for
from .errors import PoolExhausted
from .layout import BlockLayout, pack_blocks, unpack_blocks

_ALIGN = 64


class BlockKeeper(Protocol):
    """Keeps blocks nobody holds, until an allocation needs them (see the module doc)."""

    def keeps(self, block: int) -> bool: ...  # whether to keep this block once nobody holds it
    def kept(self, block: int) -> None: ...  # it is now kept (nobody holds it)
    def taken(self, block: int) -> None: ...  # a kept block is held again
    def evict(self, count: int) -> list[int]: ...  # give up to `count` kept blocks back
    @property
    def num_kept(self) -> int: ...


class BlockPool:
    def __init__(
        self,
        layout: BlockLayout,
        num_blocks: int,
        shared: bool = False,
        device: str = "cpu",
        pinned: bool = False,
    ):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"kv_pool_blocks: expected a positive integer, got {num_blocks!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_bytes = layout.block_bytes
        self.nbytes = num_blocks * self.block_bytes
        self.device = torch.device(device)
        self.checksum_kind = kind_for(self.device)
        self.shm_path: str | None = None
        self._ipc_handle: str | None = None
        self._ipc_view: torch.Tensor | None = None
        if self.device.type != "cpu":
            # One device allocation (the caching allocator aligns it to 512 bytes); shared or
            # not, a GPU pool is shared by CUDA IPC handle.
            self._storage = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            offset = 0
        elif shared:
            # Page-aligned; untouched pages cost nothing, as with torch.empty.
            self._fd = os.memfd_create("omni-pd-kv-pool", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, self.nbytes)
            self._map = mmap.mmap(self._fd, self.nbytes)
            self._storage = torch.frombuffer(self._map, dtype=torch.uint8)
            self.shm_path = f"/proc/{os.getpid()}/fd/{self._fd}"
            offset = 0
        else:
            # torch.empty: untouched pages cost nothing; every block is fully written before it is read.
            self._storage = torch.empty(
                self.nbytes + _ALIGN, dtype=torch.uint8, device="cpu", pin_memory=pinned
            )
            offset = (-self._storage.data_ptr()) % _ALIGN
        self._blocks = self._storage[offset : offset + self.nbytes].view(num_blocks, self.block_bytes)
        self.base_address = self._blocks.data_ptr()
        self._free = np.ones(num_blocks, dtype=bool)
        self._refs = np.zeros(num_blocks, dtype=np.int64)  # holders per block
        self.keeper: BlockKeeper | None = None

    @property
    def cuda_ipc_handle(self) -> str | None:
        """A GPU pool's CUDA IPC handle (exported once); None for a host pool."""
        if self.device.type == "cpu":
            return None
        if self._ipc_handle is None:
            from .transport.cuda_ipc import export_handle

            # The exported tensor lives as long as the pool: in the exporting process the handle
            # resolves to it (CUDA opens no handle in the process that made it).
            self._ipc_view = self._blocks.view(-1)
            self._ipc_handle = export_handle(self._ipc_view)
        return self._ipc_handle

    def memory(self) -> torch.Tensor:
        """The whole pool as one flat uint8 tensor (a view)."""
        return self._blocks.view(-1)

    def block_checksum(self, i: int, nbytes: int) -> str:
        """The checksum of block i's first `nbytes` bytes, of this pool's kind."""
        return checksum(self.block_view(i)[:nbytes], self.checksum_kind)

    def block_checksums(self, ids: Sequence[int], nbytes: Sequence[int]) -> list[str]:
        """`block_checksum` of each (block, length), a GPU pool's in one pass (see checksums)."""
        return checksums([self.block_view(i)[:n] for i, n in zip(ids, nbytes)], self.checksum_kind)

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones, and those a keeper would give up."""
        return int(self._free.sum()) + (self.keeper.num_kept if self.keeper else 0)

    @property
    def num_used(self) -> int:
        """Blocks somebody holds."""
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n < 1:
            raise ValueError(f"allocate needs n >= 1, got {n}")
        free = self.num_free
        short = n - int(self._free.sum())
        if short > 0 and self.keeper is not None and n <= free:
            evicted = self.keeper.evict(short)
            self._free[evicted] = True
        if n > free:
            raise PoolExhausted(
                f"KV block pool exhausted: {n} blocks requested, {free} of {self.num_blocks} free "
                f"({self.block_bytes} bytes each); raise engine_args.kv_pool_blocks, or lower "
                "concurrency / prompt length"
            )
        start = self._first_run(n)
        ids = list(range(start, start + n)) if start is not None else np.flatnonzero(self._free)[:n].tolist()
        self._free[ids] = False
        self._refs[ids] = 1
        return ids

    def hold(self, ids: Iterable[int]) -> None:
        """One more holder for each block: held ones, or kept ones (the keeper is told)."""
        ids = list(ids)
        self._check_ids(ids)
        loose = [i for i in ids if self._free[i]]
        if loose:
            raise ValueError(f"hold of free KV blocks {loose}")
        for i in ids:
            if self._refs[i] == 0:
                # Not free and held by nobody: kept, which only a keeper does (see free()).
                assert self.keeper is not None, f"KV block {i} is kept but the pool has no keeper"
                self.keeper.taken(i)
            self._refs[i] += 1

    def _first_run(self, n: int) -> int | None:
        """Lowest start index of n consecutive free blocks, or None."""
        padded = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.diff(padded)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        fits = np.flatnonzero(ends - starts >= n)
        return int(starts[fits[0]]) if fits.size else None

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        self._check_ids(ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"free: block ids repeated in {ids}")
        already = [i for i in ids if self._refs[i] == 0]
        if already:
            # Validate everything before touching state, so a bad call frees nothing.
            raise ValueError(f"double free of KV blocks {already}: they are not allocated")
        for i in ids:
            self._refs[i] -= 1
            if self._refs[i]:
                continue
            if self.keeper is not None and self.keeper.keeps(i):
                self.keeper.kept(i)
            else:
                self._free[i] = True

    def holders(self, i: int) -> int:
        return int(self._refs[i])

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside 0..{self.num_blocks - 1}")

    # -- memory ------------------------------------------------------------------------------
    def block_address(self, i: int) -> int:
        self._check_ids([i])
        return self.base_address + i * self.block_bytes

    def typed_blocks(self) -> torch.Tensor:
        """The whole pool as `[num_blocks, block_bytes / itemsize]` of the layout's dtype (a view:
        an engine's paged cache lives in it)."""
        return self._blocks.view(self.layout.torch_dtype)

    def block_view(self, i: int) -> torch.Tensor:
        """Mutable uint8 view of block i (no copy)."""
        self._check_ids([i])
        return self._blocks[i]

    def _run_start(self, block_ids: Sequence[int]) -> int | None:
        """First id if block_ids is one ascending run of consecutive ids, else None."""
        ids = list(block_ids)
        return ids[0] if ids and ids == list(range(ids[0], ids[0] + len(ids))) else None

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[len(block_ids), block_bytes]`` uint8: a view of the pool when the ids are one
        ascending run (valid only while the caller holds the blocks), else a copy."""
        self._check_ids(block_ids)
        start = self._run_start(block_ids)
        if start is not None:
            return self._blocks[start : start + len(block_ids)]
        return self._blocks[torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)]

    def write(self, block_ids: Sequence[int], kv_canonical: torch.Tensor) -> None:
        self._check_ids(block_ids)
        needed = self.layout.num_blocks_for(int(kv_canonical.shape[3])) if kv_canonical.dim() == 5 else -1
        if needed != len(block_ids):
            raise ValueError(
                f"KV of shape {tuple(kv_canonical.shape)} needs {needed} blocks, "
                f"got {len(block_ids)} block ids"
            )
        start = self._run_start(block_ids)
        if start is not None:  # pack straight into pool memory: one copy instead of two
            pack_blocks(kv_canonical, self.layout, out=self._blocks[start : start + len(block_ids)])
        else:
            packed = pack_blocks(kv_canonical, self.layout)
            self._blocks[torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)] = packed

    def copy_blocks_from(self, other: "BlockPool", block_ids: Sequence[int]) -> None:
        """Copy blocks `block_ids` of a pool of the same geometry (on any device) into the same
        blocks here, a run of consecutive ids at a time (few large copies)."""
        if other.block_bytes != self.block_bytes:
            raise ValueError(f"copy between pools of {other.block_bytes} and {self.block_bytes} byte blocks")
        ids = sorted(block_ids)
        self._check_ids(ids)
        start = 0
        while start < len(ids):
            end = start + 1
            while end < len(ids) and ids[end] == ids[end - 1] + 1:
                end += 1
            first, count = ids[start], end - start
            self._blocks[first : first + count].copy_(other._blocks[first : first + count])
            start = end

    def read(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        return unpack_blocks(self.gather(block_ids), self.layout, num_tokens)
