"""Prefix-cache block hashes exactly as vLLM 0.32 computes them, without importing vLLM.

vLLM names each full block of a request's tokens (`vllm/v1/core/kv_cache_utils.py`,
`hash_block_tokens` via `get_request_block_hasher`) by

    hash_i = H((hash_{i-1}, tuple(block_i_token_ids), extra_keys_i))     hash_{-1} = NONE_HASH

where H is the configured `prefix_caching_hash_algo` (`vllm/utils/hashing.py`):

    "sha256"       sha256(pickle.dumps(obj, HIGHEST_PROTOCOL)).digest()    32 bytes (vLLM's default)
    "sha256_cbor"  sha256(cbor2.dumps(obj, canonical=True)).digest()      32 bytes
    "xxhash"       xxh3_128(pickle.dumps(obj, HIGHEST_PROTOCOL)).digest()  16 bytes
    "xxhash_cbor"  xxh3_128(cbor2.dumps(obj, canonical=True)).digest()    16 bytes

The tuple is (bytes, tuple of ints, tuple of extra-key tuples or None): `extra_keys_i` is None,
never an empty tuple, when a block has no extra keys. Only full blocks get a hash.

NONE_HASH (`init_none_hash`) is H(seed) of a *string* seed, resolved as
`resolve_none_hash_seed` does when the engine core starts:
  1. PYTHONHASHSEED set in the engine's environment (any value, even "" or "random"): that string;
  2. else for sha256 / sha256_cbor: the fixed "vllm-none-hash" (shared by every process);
  3. else (xxhash / xxhash_cbor): os.urandom(32).hex(), fresh per process. Nobody outside that
     process can reproduce it unless told it (vLLM's `get_none_hash_seed()`), so this module asks
     for the seed instead of guessing (`NoneHashSeedUnknown`).

Extra keys (`generate_block_hash_extra_keys`), in this order within a block:
  ("lora", lora_name, lora_path)     every block of a LoRA request
  ("mm", identifier, offset - block_start)   each multimodal item overlapping the block (the
                                     offset is negative for an item that began in an earlier block)
  ("cache_salt", salt)               block 0 only, and only for a non-empty salt
  ("prompt_embeds", sha256(raw bytes of the block's prompt-embedding rows).digest())

CBOR is encoded here (canonical CBOR of the few types involved: None, bool, int, bytes, str,
tuples), so omni-pd needs neither vLLM nor cbor2. The pickle algorithms pickle the same tuple with
the standard library. Pickle memoizes objects by identity (a second reference to one object is
written as a back-reference), so the bytes depend on which parts of vLLM's key are one object:
its tag strings ("mm", ...) are code constants, shared by every key of a block, while identifiers,
names, salts and tuples are separate objects. The keys are rebuilt here the same way (tags
interned, every other string, bytes and tuple a fresh object), whatever objects the caller passed.
The CBOR algorithms have no such dependence.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import xxhash

SUPPORTED_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# Algorithms whose NONE_HASH seed vLLM fixes when PYTHONHASHSEED is unset (collision resistant).
CRYPTOGRAPHIC_ALGOS = frozenset({"sha256", "sha256_cbor"})
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM 0.32's DEFAULT_NONE_HASH_SEED

ExtraKey = tuple  # ("lora", name, path) | ("mm", identifier, offset) | ("cache_salt", salt) | ...
BlockExtraKeys = Optional[Sequence[ExtraKey]]


class UnknownHashAlgo(ValueError):
    """A `prefix_caching_hash_algo` that vLLM 0.32 does not have."""


class NoneHashSeedUnknown(ValueError):
    """The NONE_HASH seed cannot be derived: vLLM drew it at random in its own process."""


# ---- canonical CBOR (RFC 8949 4.2.1), as cbor2.dumps(obj, canonical=True) writes these types ----


def _cbor_head(major: int, value: int) -> bytes:
    """A data item's head: major type and its argument in the shortest form."""
    if value < 24:
        return bytes([major << 5 | value])
    if value < 0x100:
        return bytes([major << 5 | 24, value])
    if value < 0x10000:
        return bytes([major << 5 | 25]) + struct.pack(">H", value)
    if value < 0x100000000:
        return bytes([major << 5 | 26]) + struct.pack(">I", value)
    return bytes([major << 5 | 27]) + struct.pack(">Q", value)


def _cbor_encode(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        value = int(obj)
        major = 0 if value >= 0 else 1
        magnitude = value if value >= 0 else -1 - value
        if magnitude < 1 << 64:
            out += _cbor_head(major, magnitude)
        else:  # bignum: tag 2 (positive) or 3 (negative) over big-endian bytes
            out += _cbor_head(6, 2 + major)
            _cbor_encode(magnitude.to_bytes((magnitude.bit_length() + 7) // 8, "big"), out)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        out += _cbor_head(2, len(data))
        out += data
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out += _cbor_head(3, len(data))
        out += data
    elif isinstance(obj, (tuple, list)):
        out += _cbor_head(4, len(obj))
        for item in obj:
            _cbor_encode(item, out)
    else:
        raise TypeError(
            f"cannot CBOR-encode a {type(obj).__name__} in a vLLM block-hash key "
            "(only None, bool, int, bytes, str and tuples occur there)"
        )


def cbor_canonical(obj: Any) -> bytes:
    """`obj` as canonical CBOR, byte for byte what cbor2.dumps(obj, canonical=True) gives for the
    types a block-hash key holds."""
    out = bytearray()
    _cbor_encode(obj, out)
    return bytes(out)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # as vLLM: 5 on Python 3.8+


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_ALGOS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle, _sha256),
    "sha256_cbor": (cbor_canonical, _sha256),
    "xxhash": (_pickle, _xxh3_128),
    "xxhash_cbor": (cbor_canonical, _xxh3_128),
}


def check_algo(algo: str) -> str:
    if algo not in _ALGOS:
        raise UnknownHashAlgo(
            f"unknown prefix_caching_hash_algo {algo!r}: vLLM 0.32 supports {', '.join(SUPPORTED_ALGOS)}"
        )
    return algo


def resolve_none_hash_seed(algo: str, hash_seed: str | None) -> str:
    """The string vLLM 0.32 derives NONE_HASH from (see the module doc).

    `hash_seed`: PYTHONHASHSEED as the vLLM engine core saw it (None: unset), or the seed the engine
    reports through `vllm.v1.core.kv_cache_utils.get_none_hash_seed()`."""
    check_algo(algo)
    if hash_seed is not None:
        return hash_seed
    if algo in CRYPTOGRAPHIC_ALGOS:
        return DEFAULT_NONE_HASH_SEED
    raise NoneHashSeedUnknown(
        f"prefix_caching_hash_algo {algo!r} with PYTHONHASHSEED unset: vLLM 0.32 seeds NONE_HASH "
        "with random bytes in its own process, so its block hashes cannot be reproduced. Set "
        "PYTHONHASHSEED for the vLLM engine and pass the same value as hash_seed, pass the seed "
        "its get_none_hash_seed() reports, or use sha256 / sha256_cbor"
    )


def _fresh(value: Any) -> Any:
    """A new object equal to `value` (pickle must not find it in its memo; see the module doc)."""
    if isinstance(value, (tuple, list)):
        return tuple(_fresh(item) for item in value)
    if isinstance(value, str):
        text = str(value)
        return text[:1] + text[1:] if len(text) > 1 else text  # 0/1-long: shared in vLLM too
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return data[:1] + data[1:] if len(data) > 1 else data
    return value


def _vllm_extra_keys(extra_keys: Sequence[ExtraKey]) -> tuple:
    """A block's extra keys built as vLLM builds them: a tuple of (tag, values...) tuples whose
    tags are shared constants and whose values are fresh objects."""
    keys = []
    for key in extra_keys:
        if not isinstance(key, (tuple, list)) or not key or not isinstance(key[0], str):
            raise ValueError(
                f"an extra key is a (tag, values...) tuple such as ('mm', identifier, offset), got {key!r}"
            )
        keys.append((sys.intern(str(key[0])),) + tuple(_fresh(value) for value in key[1:]))
    return tuple(keys)


class VllmBlockHasher:
    """vLLM 0.32's prefix-cache block hashes for one `prefix_caching_hash_algo` and NONE_HASH seed.

    `algo`: one of SUPPORTED_ALGOS. `hash_seed`: the vLLM engine's PYTHONHASHSEED (None: unset)
    or the seed its `get_none_hash_seed()` reports; None is refused for the xxhash algorithms,
    whose unseeded NONE_HASH is random (`NoneHashSeedUnknown`)."""

    def __init__(self, algo: str, hash_seed: str | None = None):
        self.algo = check_algo(algo)
        self._serialize, self._digest = _ALGOS[algo]
        self.seed = resolve_none_hash_seed(algo, hash_seed)
        self.none_hash = self.hash_object(self.seed)  # the parent of every prompt's first block

    def hash_object(self, obj: Any) -> bytes:
        """H(obj): the algorithm's serialization of `obj`, hashed (vLLM's `caching_hash_fn`)."""
        return self._digest(self._serialize(obj))

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: BlockExtraKeys = None
    ) -> bytes:
        """One full block's hash (`hash_block_tokens`). `parent`: the previous block's hash; None
        or b"" for a first block (NONE_HASH). Empty `extra_keys` count as None, as in vLLM."""
        ids = tuple(operator.index(t) for t in token_ids)  # numpy ints -> int: pickle tells apart
        keys = _vllm_extra_keys(extra_keys) if extra_keys else None
        return self.hash_object((parent or self.none_hash, ids, keys))

    def block_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys_per_block: Sequence[BlockExtraKeys] | None = None,
    ) -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids` (a partial last block gets none).

        `block_size`: vLLM's hash block size (the scheduler's block size). `extra_keys_per_block`:
        one entry per full block (see `block_extra_keys`), or None for none at all."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        num_blocks = len(token_ids) // block_size
        if extra_keys_per_block is not None and len(extra_keys_per_block) != num_blocks:
            raise ValueError(
                f"extra_keys_per_block has {len(extra_keys_per_block)} entries for "
                f"{num_blocks} full blocks ({len(token_ids)} tokens, block_size "
                f"{block_size})"
            )
        hashes: list[bytes] = []
        parent = self.none_hash
        for i in range(num_blocks):
            keys = extra_keys_per_block[i] if extra_keys_per_block is not None else None
            parent = self.hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
            hashes.append(parent)
        return hashes


@dataclass(frozen=True)
class MultimodalSpan:
    """A multimodal item's placeholder tokens [offset, offset + length) and its identifier (vLLM's
    `MultiModalFeatureSpec.identifier`: the item's content hash, LoRA-prefixed under LoRA)."""

    identifier: str
    offset: int
    length: int


def block_extra_keys(
    num_tokens: int,
    block_size: int,
    *,
    mm_spans: Sequence[MultimodalSpan] = (),
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    prompt_embeds: Any = None,
) -> list[tuple | None]:
    """Each full block's extra keys as vLLM 0.32's `generate_block_hash_extra_keys` makes them.

    `mm_spans`: sorted by offset and not overlapping (vLLM assumes as much). `lora`: the request's
    (lora_name, lora_path). `prompt_embeds`: the prompt's embeddings, rows = token positions, as an
    array numpy can read (a bfloat16 torch tensor: `t.view(torch.uint8).numpy()`, which keeps the
    rows); each block's key hashes its rows' raw bytes, as vLLM does."""
    for before, after in zip(mm_spans, mm_spans[1:]):
        if after.offset < before.offset + before.length:
            raise ValueError(f"multimodal spans must be sorted and disjoint: {before} then {after}")
    rows = None
    if prompt_embeds is not None:
        import numpy as np  # only prompt-embedding requests need it

        rows = np.asarray(prompt_embeds)
    keys: list[tuple | None] = []
    for i in range(num_tokens // block_size):
        start, end = i * block_size, (i + 1) * block_size
        block: list[tuple] = []
        if lora is not None:
            block.append(("lora", lora[0], lora[1]))
        block += [
            ("mm", span.identifier, span.offset - start)
            for span in mm_spans
            if span.offset < end and span.offset + span.length > start
        ]
        if start == 0 and cache_salt:
            block.append(("cache_salt", cache_salt))
        if rows is not None:
            digest = hashlib.sha256(np.ascontiguousarray(rows[start:end]).tobytes()).digest()
            block.append(("prompt_embeds", digest))
        keys.append(tuple(block) if block else None)
    return keys
