"""The thinker's paged KV cache, owned by its engine.

One tensor `[num_blocks, layers, 2 (K, V), kv_heads, block_size, head_dim]`: a block holds
`block_size` positions of every layer, so one request's block is one contiguous span (what a KV
handoff can later register and move as it is). A request owns a list of block ids (its block
table); positions fill its blocks in order. Blocks are reserved for the prompt plus `max_tokens`
when a request is admitted, so a running request never waits for a block and nothing is
preempted.
"""
from __future__ import annotations

import torch

from ...kv.errors import PoolExhausted


class PagedKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.data = torch.zeros((num_blocks, num_layers, 2, kv_heads, block_size, head_dim), dtype=dtype)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out ascending ids

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def allocate(self, positions: int) -> list[int]:
        needed = self.blocks_for(positions)
        if needed > len(self._free):
            raise PoolExhausted(f"the thinker's KV cache has {len(self._free)} free blocks of "
                                f"{self.block_size} tokens, {needed} needed for {positions} positions")
        return [self._free.pop() for _ in range(needed)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def write(self, blocks: list[int], start: int, kv: torch.Tensor) -> None:
        """Store canonical KV `[layers, 2, kv_heads, tokens, head_dim]` at positions
        `start .. start + tokens` of a request."""
        tokens = kv.shape[3]
        done = 0
        while done < tokens:
            block, offset = divmod(start + done, self.block_size)
            count = min(self.block_size - offset, tokens - done)
            self.data[blocks[block], :, :, :, offset:offset + count] = kv[:, :, :, done:done + count]
            done += count

    def read(self, blocks: list[int], length: int) -> torch.Tensor:
        """Positions `0 .. length` of a request as canonical KV `[layers, 2, kv_heads, length, hd]`."""
        used = self.data[blocks[:self.blocks_for(length)]]  # [nb, layers, 2, kvh, bs, hd]
        kv = used.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        return kv[:, :, :, :length].contiguous()

    def write_token(self, layer: int, blocks: list[int], position: int, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """K and V `[kv_heads, head_dim]` of one new position."""
        block, offset = divmod(position, self.block_size)
        self.data[blocks[block], layer, 0, :, offset] = k
        self.data[blocks[block], layer, 1, :, offset] = v

    def layer_kv(self, layer: int, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[kv_heads, length, head_dim]` of one layer of a request."""
        used = self.data[blocks[:self.blocks_for(length)], layer]  # [nb, 2, kvh, bs, hd]
        kv = used.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :length]
        return kv[0], kv[1]
