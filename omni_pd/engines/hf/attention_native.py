"""Decode attention for the batched thinker and talker on the C kernel of native/attention.c.

A decode step attends one new position per sequence over that sequence's own cache. The torch
path does it per sequence (a cache write and a `scaled_dot_product_attention` call each: ~4 ops,
~40 us a sequence a layer); the kernel does every sequence of a layer in one call, each sequence
computed alone, so a request's output still does not depend on its batch. It differs from torch's
attention in the last bits only (tests/test_attention_native.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import experts_native
from .native_build import SOURCES, NativeKernel, build_id, check_choice, load

ATTENTION = NativeKernel(
    "attention", SOURCES / "attention.c", "the autoregressive stages' engine_args.attention_kernels: torch"
)

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load(ATTENTION)
        lib.omni_attn_decode.argtypes = [
            _I,
            _I,
            _I,
            _I,
            _F,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _L,
            _L,
            _L,
            _L,
            _P,
        ]
        lib.omni_attn_decode.restype = None
        _lib = lib
    return _lib


def check_kernels(kernels: str) -> str:
    """The `attention_kernels` value, checked; `native` (decode attention and the MoE experts'
    kernel) is built (or loaded) here."""
    if check_choice(kernels, "attention_kernels") == "native":
        _library()  # build (or load) now: a missing compiler fails the stage at start
        experts_native.check()
    return kernels


def native_builds(kernels: str) -> dict[str, str]:
    """The native builds a stage running on `kernels` computes with (decode attention, MoE
    experts), for its compute identity."""
    return {ATTENTION.name: build_id(ATTENTION), **experts_native.builds()} if kernels == "native" else {}


@dataclass
class CacheGeometry:
    """Where a cache keeps position p of a sequence, in floats: block `p // block` of its table
    at `block_stride`, then `(p % block) * pos_stride`, kv head g at `g * head_stride`."""

    block: int
    block_stride: int
    pos_stride: int
    head_stride: int


class DecodeRows:
    """One decode step's sequences: their block tables and lengths (the new position included),
    set up once per step and shared by every layer's call."""

    def __init__(self, tables: list[list[int]], lengths: list[int]):
        starts: list[int] = []
        flat: list[int] = []
        for table in tables:
            starts.append(len(flat))
            flat.extend(table)
        self.count = len(lengths)
        self.tables = torch.tensor(flat, dtype=torch.long)
        self.starts = torch.tensor(starts, dtype=torch.long)
        self.lengths = torch.tensor(lengths, dtype=torch.long)
        self.scratch = torch.empty(max(lengths) + 1024, dtype=torch.float32)


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    rows: DecodeRows,
    k_bases: torch.Tensor,
    v_bases: torch.Tensor,
    geometry: CacheGeometry,
    scale: float,
) -> torch.Tensor:
    """Write each sequence's new key and value (`k_new`, `v_new` [B, kv_heads, d]) at its last
    position, then attend `q` ([B, heads, d]) over its cache; returns [B, heads, d]. `k_bases`,
    `v_bases`: int64 addresses of each sequence's position-0 key / value (float32 caches)."""
    batch, heads, d = q.shape
    kv_heads = k_new.shape[1]
    for t in (q, k_new, v_new):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("the native decode attention takes contiguous float32 tensors")
    if rows.count != batch:
        raise ValueError(f"{batch} query rows for a step of {rows.count} sequences")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads evenly")
    if d > 1024:
        raise ValueError(f"head size {d} is larger than the kernel's scratch allows")
    out = torch.empty_like(q)
    _library().omni_attn_decode(
        batch,
        heads,
        kv_heads,
        d,
        scale,
        q.data_ptr(),
        k_new.data_ptr(),
        v_new.data_ptr(),
        out.data_ptr(),
        k_bases.data_ptr(),
        v_bases.data_ptr(),
        rows.tables.data_ptr(),
        rows.starts.data_ptr(),
        rows.lengths.data_ptr(),
        geometry.block,
        geometry.block_stride,
        geometry.pos_stride,
        geometry.head_stride,
        rows.scratch.data_ptr(),
    )
    return out


def paged_geometry(cache, layer: int) -> tuple[int, int, CacheGeometry]:
    """Addresses of layer `layer`'s K and V at block 0, position 0 of a `PagedKVCache`, and its
    strides, for the kernel: blocks are [block_size, layers, 2, kv_heads, hd], float32."""
    data = cache.data
    if data.dtype != torch.float32 or not data.is_contiguous():
        raise ValueError("the native decode attention reads a contiguous float32 paged cache")
    block_size = data.shape[1]
    k_base = data[0, 0, layer, 0].data_ptr()
    v_base = data[0, 0, layer, 1].data_ptr()
    geometry = CacheGeometry(
        block=block_size, block_stride=data.stride(0), pos_stride=data.stride(1), head_stride=data.stride(4)
    )
    return k_base, v_base, geometry
