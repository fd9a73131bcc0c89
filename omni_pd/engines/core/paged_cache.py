"""An autoregressive stage's paged KV cache, owned by its engine.

The cache is one `BlockPool` of the KV plane (one aligned buffer, registered with Mooncake by a
P/D engine) in the KV plane's default block layout, fused and token-major: block b is the tensor
`data[b]` of shape `[block_size, layers, 2 (K, V), kv_heads, head_dim]`. So a request's block is
one contiguous span across all layers, its first n positions are a contiguous prefix of it, and
the handoff moves a prefill engine's blocks straight into a decode engine's blocks: no pack, no
unpack, no staging copy when both sides share the layout.

A request owns a list of block ids (its block table); positions fill its blocks in order, and
the table grows as they need blocks (engines/core/scheduler.py).
"""

from __future__ import annotations

import torch

from ...kv.errors import PoolExhausted
from ...kv.layout import BlockLayout
from ...kv.pool import BlockPool


class PagedKVCache:
    def __init__(
        self,
        layout: BlockLayout,
        num_blocks: int,
        shared: bool = False,
        device: str = "cpu",
    ):
        """`shared`: the pool in shared memory a decode process on this host can map (the
        prefill leg's, for the same-host KV path; a GPU pool is shared by CUDA IPC handle).
        `device`: where the blocks live (the model's device)."""
        if (layout.kv_split, layout.order) != ("fused", "token_major"):
            raise ValueError(
                f"the paged cache stores fused token-major blocks, not {layout.kv_split} {layout.order}"
            )
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(layout, num_blocks, shared=shared, device=device)
        self.data = self.pool.typed_blocks().view(
            num_blocks, layout.block_size, layout.num_layers, 2, layout.num_kv_heads, layout.head_dim
        )

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have (idle cached blocks are evicted for it, where a prefix
        cache keeps the pool)."""
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def allocate(self, positions: int, have: int = 0) -> list[int]:
        """Blocks for `positions` positions of a request that holds `have` blocks already (its
        cached prefix): the rest."""
        needed = self.blocks_for(positions) - have
        if needed > self.pool.num_free:
            raise PoolExhausted(
                f"the KV cache has {self.pool.num_free} free blocks of "
                f"{self.block_size} tokens, {needed} needed for {positions} positions"
            )
        return self.pool.allocate(needed) if needed > 0 else []

    def release(self, blocks: list[int]) -> None:
        if blocks:
            self.pool.free(blocks)

    def write(
        self, blocks: list[int], start: int, kv: torch.Tensor, checksums: bool = False
    ) -> list[str] | None:
        """Store canonical KV `[layers, 2, kv_heads, tokens, head_dim]` at positions
        `start .. start + tokens` of a request. `checksums` (a prompt written from position 0,
        for the KV handoff): also return each written block's checksum over its filled bytes,
        taken right after the block is written, while it is still in cache."""
        if checksums and start != 0:
            raise ValueError("block checksums cover a prompt written from position 0")
        tokens = kv.shape[3]
        by_token = kv.permute(3, 0, 1, 2, 4)  # [tokens, layers, 2, kv_heads, head_dim]
        sums: list[str] = []
        written: list[tuple[int, int]] = []  # (block, filled bytes)
        # A host pool's checksum (xxh3) is taken as each block is written, while it is in cache;
        # a GPU pool's (wsum64) for all blocks at once, in one pass and one sync.
        at_once = self.pool.checksum_kind == "wsum64"
        done = 0
        while done < tokens:
            block, offset = divmod(start + done, self.block_size)
            count = min(self.block_size - offset, tokens - done)
            self.data[blocks[block], offset : offset + count] = by_token[done : done + count]
            if checksums:
                filled = (offset + count) * self.layout.bytes_per_token
                if at_once:
                    written.append((blocks[block], filled))
                else:
                    sums.append(self.pool.block_checksum(blocks[block], filled))
            done += count
        if written:
            sums = self.pool.block_checksums([b for b, _ in written], [n for _, n in written])
        return sums if checksums else None

    def checksums(self, blocks: list[int], length: int, first: int = 0) -> list[str]:
        """Each block's checksum over its filled bytes, for positions `0 .. length`, from block
        `first` on."""
        indices = range(first, self.blocks_for(length))
        filled = [
            min(self.block_size, length - i * self.block_size) * self.layout.bytes_per_token for i in indices
        ]
        return self.pool.block_checksums([blocks[i] for i in indices], filled)

    def read(self, blocks: list[int], length: int) -> torch.Tensor:
        """Positions `0 .. length` of a request as canonical KV `[layers, 2, kv_heads, length, hd]`."""
        used = self.data[blocks[: self.blocks_for(length)]]  # [nb, bs, layers, 2, kvh, hd]
        return used.flatten(0, 1)[:length].permute(1, 2, 3, 0, 4).contiguous()

    def write_token(
        self, layer: int, blocks: list[int], position: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """K and V `[kv_heads, head_dim]` of one new position."""
        block, offset = divmod(position, self.block_size)
        self.data[blocks[block], offset, layer, 0] = k
        self.data[blocks[block], offset, layer, 1] = v

    def layer_kv(self, layer: int, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[kv_heads, length, head_dim]` of one layer of a request."""
        used = self.data[blocks[: self.blocks_for(length)], :, layer]  # [nb, bs, 2, kvh, hd]
        kv = used.permute(2, 3, 0, 1, 4).flatten(2, 3)[:, :, :length]
        return kv[0], kv[1]
