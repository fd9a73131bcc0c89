"""The hf stages' `ComputeBackend` (engines/core/attention.py): their attention kernels, the
batch-invariance switch and the compute identity, behind the one interface the core calls.

Decode attention runs on the C kernel of `attention_native` (every sequence of a layer in one
call, each computed alone: `native`) or on torch's attention per sequence (`torch`). A prompt's
rows attend on `batch_invariant.attend_rows` (row-invariant: the prefix cache and chunked prefill
rely on it) or, for a stage that asks for it, torch's fused causal attention (`attend`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..core.attention import SequenceSlot
from ..core.paged_cache import PagedKVCache
from . import batch_invariant as bi
from .attention_native import DecodeRows, check_kernels, decode_attention, paged_geometry
from .compute_identity import compute_identity


class HfCompute:
    """`kernels`: the stage's `attention_kernels` (native or torch), checked (and the native
    library built) here."""

    def __init__(self, kernels: str = "native"):
        self.name = check_kernels(kernels)

    def decode_plan(self, tables: Sequence[Sequence[int]], lengths: Sequence[int]) -> DecodeRows | None:
        return DecodeRows([list(t) for t in tables], list(lengths)) if self.name == "native" else None

    def decode(
        self,
        cache: PagedKVCache,
        layer: int,
        plan: Any,
        slots: Sequence[SequenceSlot],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        count = q.shape[0]
        if plan is not None:
            k_base, v_base, geometry = paged_geometry(cache, layer)
            out = decode_attention(
                q.contiguous(),
                k.contiguous(),
                v.contiguous(),
                plan,
                torch.full((count,), k_base, dtype=torch.long),
                torch.full((count,), v_base, dtype=torch.long),
                geometry,
                scale,
            )
            return out.reshape(count, -1)
        rows = []
        for b, slot in enumerate(slots):
            cache.write_token(layer, slot.blocks, slot.start, k[b], v[b])
            keys, values = cache.layer_kv(layer, slot.blocks, slot.start + 1)
            rows.append(
                F.scaled_dot_product_attention(
                    q[b : b + 1].unsqueeze(2),
                    keys.unsqueeze(0),
                    values.unsqueeze(0),
                    scale=scale,
                    enable_gqa=True,
                )[:, :, 0]
            )
        return torch.cat(rows).reshape(count, -1)

    def prompt_rows(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, start: int
    ) -> torch.Tensor:
        return bi.attend_rows(q, keys, values, scale, start)

    def prompt_fused(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return bi.attend(q, keys, values, scale, 0)

    def set_batch_invariant(self, enabled: bool) -> None:
        bi.set_enabled(enabled)

    def compute_identity(self, device: str, native_kernels: Mapping[str, str]) -> dict[str, Any]:
        return compute_identity(device, dict(native_kernels))
