"""One KV manager per autoregressive engine: its paged cache, prefix cache and their counters.

The API every engine uses, whatever its model (vLLM's `KVCacheManager` is the model):
`match` a prompt's cached prefix, `allocate` blocks for a request, `register` its full prompt
blocks for later prompts, `free` them, and the counters the router and /metrics read. Blocks are
allocated as a request's positions need them (the scheduler preempts when they run out).

Beside each named block the manager can keep rows per position that the next stage needs and
that a prompt prefilled over cached blocks does not compute again (`row_widths`: a model's
per-position outputs, such as the embeddings and hidden states a speech stage reads).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ...kv.layout import BlockLayout
from .paged_cache import PagedKVCache
from .prefix_cache import OMNI_PD_NAMING, BlockNaming, PrefixCache


class KVManager:
    def __init__(
        self,
        layout: BlockLayout,
        num_blocks: int,
        *,
        shared: bool = False,
        prefix_caching: bool = False,
        device: str = "cpu",
        row_widths: Mapping[str, int] | None = None,
        row_dtype: torch.dtype = torch.float32,
        naming: BlockNaming = OMNI_PD_NAMING,
    ):
        # The memory (blocks in the KV plane's layout) and, with prefix caching, the names of full
        # prompt blocks kept after use (prefix_cache.py: it keeps the pool, evicting idle ones).
        self.cache = PagedKVCache(layout, num_blocks, shared=shared, device=device)
        self.prefix = PrefixCache(self.cache.pool, naming=naming) if prefix_caching else None
        self.naming = naming
        self.layout = self.cache.layout
        self.block_size = self.cache.block_size
        self.prefix_caching = prefix_caching
        self.query_tokens = self.hit_tokens = 0
        self._rows = (
            {
                name: torch.zeros((num_blocks, self.block_size, width), dtype=row_dtype)
                for name, width in (row_widths or {}).items()
            }
            if prefix_caching
            else {}
        )

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def num_free(self) -> int:
        return self.cache.num_free

    @property
    def num_used(self) -> int:
        return self.cache.num_used

    @property
    def num_cached(self) -> int:
        return self.prefix.num_cached if self.prefix is not None else 0

    def blocks_for(self, positions: int) -> int:
        return self.cache.blocks_for(positions)

    # ---- blocks -------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], extra_keys: Sequence[bytes], limit: int) -> list[int]:
        """The cached blocks holding the longest prefix of `token_ids` in whole blocks (at most
        `limit` tokens), each held once more for the caller; [] without prefix caching."""
        if self.prefix is None:
            return []
        return self.prefix.match(token_ids, extra_keys, limit=limit)

    def block_hashes(self, token_ids: Sequence[int], extra_keys: Sequence[bytes]) -> list[bytes]:
        """The names the prefix cache gives the full blocks of `token_ids` (its `naming`); []
        without prefix caching."""
        if self.prefix is None:
            return []
        return self.prefix.block_hashes(token_ids, extra_keys)

    def count_query(self, queried: int, hit: int) -> None:
        self.query_tokens += queried
        self.hit_tokens += hit

    def allocate(self, positions: int, have: int = 0) -> list[int]:
        """Blocks for `positions` positions of a request that holds `have` blocks already."""
        return self.cache.allocate(positions, have=have)

    def free(self, blocks: list[int]) -> None:
        self.cache.release(blocks)

    def register(
        self,
        blocks: Sequence[int],
        token_ids: Sequence[int],
        extra_keys: Sequence[bytes],
        checksums: Sequence[str] = (),
    ) -> None:
        """Name a prompt's full blocks (its block table from position 0) for later prompts."""
        if self.prefix is not None:
            self.prefix.register(blocks, token_ids, extra_keys, checksums=checksums)

    def checksum(self, block: int) -> str | None:
        """The checksum a named block's bytes had when it was named."""
        return self.prefix.checksum(block) if self.prefix is not None else None

    # ---- rows kept beside named blocks ----------------------------------------------------------
    @property
    def keeps_rows(self) -> bool:
        return bool(self._rows)

    def keep_rows(
        self, blocks: Sequence[int], first: int, last: int, rows: Mapping[str, torch.Tensor], offset: int
    ) -> None:
        """Store rows of prompt blocks `first .. last - 1` (block table `blocks`); row 0 of each
        tensor in `rows` is prompt position `offset`."""
        size = self.block_size
        for name, store in self._rows.items():
            for index in range(first, last):
                start = index * size - offset
                store[blocks[index]] = rows[name][start : start + size]

    def cached_rows(self, blocks: Sequence[int]) -> dict[str, torch.Tensor]:
        """The rows kept for `blocks`, positions in order: {name: [len(blocks) * size, width]}."""
        return {name: store[list(blocks)].flatten(0, 1) for name, store in self._rows.items()}

    # ---- KV bytes -----------------------------------------------------------------------------
    def write(
        self, blocks: list[int], start: int, kv: torch.Tensor, checksums: bool = False
    ) -> list[str] | None:
        return self.cache.write(blocks, start, kv, checksums=checksums)

    def checksums(self, blocks: list[int], length: int, first: int = 0) -> list[str]:
        return self.cache.checksums(blocks, length, first=first)
