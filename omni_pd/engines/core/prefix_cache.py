"""Content-addressed full blocks of a paged KV cache: prefix caching.

A full block of a prompt is named by a chained hash, as vLLM's `hash_block_tokens` names it: the
parent block's hash, the block's token ids, and extra keys for what the tokens do not say (a
hash of a multimodal input's content). So equal hashes mean equal prefixes up to and including
the block. By default (`OMNI_PD_NAMING`) this uses xxh3-128 over a fixed byte encoding (parent
hash, the ids as little-endian int64, the extra keys' bytes): the same chain as vLLM's, not the
same numbers. With `prefix_caching_hash_algo` set on the stage (`vllm_naming`), blocks are named
by vLLM's own hashes (kv/vllm/block_hash.py): a block of text tokens gets the key a vLLM engine
with the same algorithm and NONE_HASH seed gives it, so keys can be exchanged with vLLM. A block
holding audio is keyed by omni-pd's content key of the clip under its own tag, never equal to a
vLLM key (vLLM's multimodal identifiers come from its own processor's hasher).

A hash hit is still checked: the cache keeps each block's token ids and extra keys and reuses it
only when they are equal too, so a collision can cost a recompute, never a wrong answer.

The pool counts holders per block (`kv.pool.BlockPool`): a request holds each block it uses (its
own and the cached ones it reuses), a published KV lease the blocks it lends. This cache is the
pool's keeper: a named block that its last holder lets go stays in the cache, least recently
used first in line for eviction, and an allocation that finds too few free blocks evicts from
that line, so cached blocks never keep a request out.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import xxhash

from ...kv.pool import BlockPool
from ...kv.vllm.block_hash import CRYPTOGRAPHIC_ALGOS, VllmBlockHasher

log = logging.getLogger(__name__)

ROOT_HASH = b"\0" * 16  # the parent of a prompt's first block
# The extra-key tag of a block holding audio under vLLM naming (see the module doc).
AUDIO_KEY_TAG = "omni_pd_audio"

HashFn = Callable[[bytes, Sequence[int], bytes], bytes]


def block_hash(parent: bytes, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """The chained hash of one full block (see the module doc)."""
    digest = xxhash.xxh3_128()
    digest.update(parent)
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    digest.update(len(extra_keys).to_bytes(8, "little"))
    digest.update(extra_keys)
    return digest.digest()


def multimodal_extra_keys(
    spans: Sequence[tuple[int, int, bytes]], num_tokens: int, block_size: int
) -> list[bytes]:
    """Each full block's extra keys, as vLLM's `_gen_mm_extra_hash_keys` makes them: the keys of
    the multimodal inputs whose placeholder positions [start, end) overlap the block, in order.
    A block of text only has none."""
    keys = []
    for i in range(num_tokens // block_size):
        first, last = i * block_size, (i + 1) * block_size
        keys.append(b"".join(key for start, end, key in spans if start < last and end > first))
    return keys


@dataclass(frozen=True)
class BlockNaming:
    """How a prefix cache names full blocks: the first block's parent, the chained hash, and a
    description an operator can compare between engines (`describe`)."""

    scheme: str  # "omni-pd-xxh3-128" or "vllm:<prefix_caching_hash_algo>"
    root: bytes
    hash: HashFn
    seed_rule: str = "none"  # where vLLM naming's NONE_HASH seed came from

    def describe(self) -> str:
        return (
            self.scheme if self.seed_rule == "none" else f"{self.scheme} (NONE_HASH seed: {self.seed_rule})"
        )


OMNI_PD_NAMING = BlockNaming("omni-pd-xxh3-128", ROOT_HASH, block_hash)


def vllm_naming(hasher: VllmBlockHasher, seed_rule: str) -> BlockNaming:
    """Blocks named by vLLM's hashes under `hasher` (its algorithm and NONE_HASH seed)."""

    def hash_fn(parent: bytes, token_ids: Sequence[int], extra_keys: bytes) -> bytes:
        keys = ((AUDIO_KEY_TAG, extra_keys),) if extra_keys else None
        return hasher.hash_block(parent, token_ids, keys)

    return BlockNaming(f"vllm:{hasher.algo}", hasher.none_hash, hash_fn, seed_rule)


def naming_for(algo: str | None, environ: Mapping[str, str] = os.environ) -> BlockNaming:
    """A stage's naming: omni-pd's own without `prefix_caching_hash_algo`, else vLLM 0.32's with
    the NONE_HASH seed its engine core would pick in this environment: PYTHONHASHSEED when set,
    else the fixed seed for sha256 / sha256_cbor and a random one (this process only) for the
    xxhash algorithms, whose keys then match no other engine's."""
    if algo is None:
        return OMNI_PD_NAMING
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        rule = f"PYTHONHASHSEED={seed!r}"
    elif algo in CRYPTOGRAPHIC_ALGOS:
        rule = "vLLM's fixed default"
    else:
        seed, rule = os.urandom(32).hex(), "random, this process only (PYTHONHASHSEED unset)"
    return vllm_naming(VllmBlockHasher(algo, seed), rule)


@dataclass(frozen=True)
class _Entry:
    hash: bytes
    token_ids: tuple[int, ...]
    extra_keys: bytes
    checksum: str | None  # of the block's bytes when it was named (a later change shows)


class PrefixCache:
    """The hash table and the eviction line of one block pool, which it keeps blocks for."""

    def __init__(self, pool: BlockPool, hash_fn: HashFn | None = None, naming: BlockNaming = OMNI_PD_NAMING):
        self.pool = pool
        self.block_size = pool.layout.block_size
        self.naming = naming
        self._root = naming.root
        self._hash = hash_fn or naming.hash  # a test may force collisions
        self._entries: dict[int, _Entry] = {}  # named block -> what it holds
        self._by_hash: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named blocks nobody holds, LRU first
        self.evictions = 0
        pool.keeper = self

    # ---- the pool's keeper ----------------------------------------------------------------------
    def keeps(self, block: int) -> bool:
        return block in self._entries

    def kept(self, block: int) -> None:
        self._idle[block] = None  # most recently used last

    def taken(self, block: int) -> None:
        del self._idle[block]

    def evict(self, count: int) -> list[int]:
        evicted: list[int] = []
        while self._idle and len(evicted) < count:
            block, _ = self._idle.popitem(last=False)
            self._forget(block)
            evicted.append(block)
        self.evictions += len(evicted)
        return evicted

    @property
    def num_kept(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    # ---- prompts ----------------------------------------------------------------------------
    def match(
        self, token_ids: Sequence[int], extra_keys: Sequence[bytes] = (), limit: int | None = None
    ) -> list[int]:
        """The cached blocks that hold the longest prefix of `token_ids` in whole blocks (at most
        `limit` tokens), each now held once more by the caller (who frees them as its own).
        `extra_keys[i]`: block i's."""
        count = min(len(token_ids), limit if limit is not None else len(token_ids))
        found: list[int] = []
        for _, ids, extra, digest in self._chain(token_ids[:count], extra_keys):
            block = self._by_hash.get(digest)
            entry = self._entries.get(block) if block is not None else None
            if block is None or entry is None or entry.token_ids != ids or entry.extra_keys != extra:
                break  # a miss, or a collision: never reuse a block for other tokens
            found.append(block)
        self.pool.hold(found)
        return found

    def block_hashes(self, token_ids: Sequence[int], extra_keys: Sequence[bytes] = ()) -> list[bytes]:
        """The names of the full blocks of `token_ids` (whether cached or not)."""
        return [digest for _, _, _, digest in self._chain(token_ids, extra_keys)]

    def checksum(self, block: int) -> str | None:
        """The checksum a named block's bytes had when it was named."""
        entry = self._entries.get(block)
        return entry.checksum if entry is not None else None

    def register(
        self,
        blocks: Sequence[int],
        token_ids: Sequence[int],
        extra_keys: Sequence[bytes] = (),
        checksums: Sequence[str] = (),
    ) -> int:
        """Name the full blocks of a prompt written into `blocks` (its block table, from
        position 0) by their hashes, so that later prompts can reuse them; `checksums[i]`, of
        block i's bytes as written, goes with its name (a KV handoff of the block later sends
        it, so memory that changed since is caught). A block whose hash another block holds
        already keeps no name (both hold the same KV). Returns how many blocks got a name."""
        named = 0
        for i, ids, extra, digest in self._chain(token_ids, extra_keys):
            block = blocks[i]
            if block not in self._entries and digest not in self._by_hash:
                self._entries[block] = _Entry(
                    digest, ids, extra, checksums[i] if i < len(checksums) else None
                )
                self._by_hash[digest] = block
                named += 1
        return named

    def _chain(self, token_ids: Sequence[int], extra_keys: Sequence[bytes]):
        """(index, token ids, extra keys, chained hash) of each full block of `token_ids`."""
        size, parent = self.block_size, self._root
        for i in range(len(token_ids) // size):
            ids = tuple(token_ids[i * size : (i + 1) * size])
            extra = extra_keys[i] if i < len(extra_keys) else b""
            parent = self._hash(parent, ids, extra)
            yield i, ids, extra, parent

    def _forget(self, block: int) -> None:
        entry = self._entries.pop(block)
        if self._by_hash.get(entry.hash) == block:
            del self._by_hash[entry.hash]

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests and soak runs)."""
        assert set(self._idle) <= set(self._entries), "an idle block has no name"
        assert all(self.pool.holders(b) == 0 for b in self._idle), "an idle block is held"
        assert all(self.pool.holders(b) > 0 for b in set(self._entries) - set(self._idle)), (
            "a named block is neither held nor idle"
        )
        assert all(self._entries[b].hash == h for h, b in self._by_hash.items()), "hash table"
