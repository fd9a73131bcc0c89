"""The engine's attention: each step's metadata over the paged cache, and the one call a model makes.

vLLM's split is the model: a model's layer calls `self.attn(q, k, v)`; the engine has built the
step's attention metadata (which blocks each sequence owns, where its new positions start) and
the backend computes. Here the engine builds a `StepAttention` for each prefill pass and each
decode step (`for_prefill`, `for_decode`) and hands it to the runner, whose layers call it:

    out = attention(layer_index, q, k, v, scale)   # q [T, heads, hd], k/v [T, kv_heads, hd]

with the step's T new rows in sequence order, and get `[T, heads * hd]` back. No runner sees a
block table, a slot or the cache:

* a prefill (from position 0, or over a cached prefix / earlier chunks already in the request's
  blocks): each sequence's new rows attend causally to its cached keys and its new ones; the new
  rows' KV is kept per sequence (`prompt_kv`) for the engine to write, publish and checksum;
* a decode step (one new row per sequence): the new key and value go into the sequence's next
  slot and the row attends over the sequence's cache.

What computes is the `ComputeBackend` a runner brings (engines/hf/compute.py for the hf stages:
the native C kernel or torch's attention, batch-invariant either way). The backend also carries
the batch-invariance switch and the compute identity, so the core imports no kernel code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import torch

from .paged_cache import PagedKVCache

# How a prompt's rows attend (a runner's `prompt_attention`):
# row_invariant: every row's bits independent of where the pass starts and how many rows share
#   it (what a prefix cache and chunked prefill need);
# fused: torch's fused causal attention over the prompt alone (no cached prefix), for a stage
#   whose prompts are never cached and whose bits follow transformers' own.
PROMPT_ATTENTION = ("row_invariant", "fused")


class ComputeBackend(Protocol):
    """The kernels a stage computes with, as the core needs them."""

    name: str  # "native" or "torch"

    def decode_plan(self, tables: Sequence[Sequence[int]], lengths: Sequence[int]) -> Any:
        """Per-step state for `decode` (built once per step, shared by every layer), or None."""

    def decode(
        self,
        cache: PagedKVCache,
        layer: int,
        plan: Any,
        slots: Sequence["SequenceSlot"],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write each sequence's new k, v ([B, kv_heads, hd]) at its slot, attend q ([B, heads,
        hd]) over its cache; [B, heads * hd]."""

    def prompt_rows(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, start: int
    ) -> torch.Tensor:
        """Row-invariant causal attention of one sequence's rows at `start ..` (q [1, heads, m,
        hd]) over its keys so far ([1, kv_heads, start + m, hd]); [m, heads * hd]."""

    def prompt_fused(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """torch's fused causal attention of a whole prompt (no cached prefix); [m, heads * hd]."""

    def set_batch_invariant(self, enabled: bool) -> None:
        """Test hook: plain (batch-dependent) linear layers in this process when False."""

    def compute_identity(self, device: str, native_kernels: Mapping[str, str]) -> Mapping[str, Any]:
        """What computes here (CPU dispatch level, native builds, device): the KV fingerprint's."""


@dataclass(frozen=True)
class SequenceSlot:
    """One sequence's place in a step: its block table, the positions already in its cache
    (`start`), and the new positions this step computes (`count`)."""

    blocks: list[int]
    start: int
    count: int


class StepAttention:
    """One step's attention over the engine's paged cache; a runner's layers call it."""

    def __init__(
        self,
        backend: ComputeBackend,
        cache: PagedKVCache | None,
        slots: Sequence[SequenceSlot],
        decode: bool,
        prompt_attention: str = "row_invariant",
    ):
        if prompt_attention not in PROMPT_ATTENTION:
            raise ValueError(f"prompt_attention {prompt_attention!r} is not one of {PROMPT_ATTENTION}")
        if not decode and prompt_attention == "fused" and any(s.start for s in slots):
            raise ValueError("fused prompt attention has no cached prefix: use row_invariant")
        if any(s.start for s in slots) and cache is None:
            raise ValueError("attention over cached positions needs their cache")
        self.backend = backend
        self.cache = cache
        self.slots = list(slots)
        self.decode = decode
        self.prompt_attention = prompt_attention
        self.rows = sum(s.count for s in self.slots)
        self._plan: Any = None
        self._kv: list[list[torch.Tensor]] = [[] for _ in self.slots]  # prefill: per sequence, per layer

    @classmethod
    def for_prefill(
        cls,
        backend: ComputeBackend,
        cache: PagedKVCache | None,
        slots: Sequence[SequenceSlot],
        prompt_attention: str = "row_invariant",
    ) -> "StepAttention":
        return cls(backend, cache, slots, decode=False, prompt_attention=prompt_attention)

    @classmethod
    def for_decode(
        cls, backend: ComputeBackend, cache: PagedKVCache, slots: Sequence[SequenceSlot]
    ) -> "StepAttention":
        if any(s.count != 1 for s in slots):
            raise ValueError("a decode step computes one new position per sequence")
        return cls(backend, cache, slots, decode=True)

    def select(self, indices: Sequence[int]) -> "StepAttention":
        """The same step for some of its sequences (a runner that leaves a failed row out)."""
        if not self.decode:
            raise ValueError("a prefill pass's sequences are its prompts: build another pass")
        return StepAttention(self.backend, self.cache, [self.slots[i] for i in indices], decode=True)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention of the step's new rows at layer `layer`: q [T, heads, hd], k and v
        [T, kv_heads, hd], rows in sequence order; returns [T, heads * hd]."""
        if q.shape[0] != self.rows or k.shape[0] != self.rows or v.shape[0] != self.rows:
            raise ValueError(
                f"attention got {q.shape[0]} query, {k.shape[0]} key and {v.shape[0]} value rows "
                f"for a step of {self.rows} new positions"
            )
        return self._decode(layer, q, k, v, scale) if self.decode else self._prefill(layer, q, k, v, scale)

    def _decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        assert self.cache is not None, "for_decode takes the cache"
        if self._plan is None:
            self._plan = self.backend.decode_plan(
                [s.blocks for s in self.slots], [s.start + 1 for s in self.slots]
            )
        return self.backend.decode(self.cache, layer, self._plan, self.slots, q, k, v, scale)

    def _prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        # Head-major views of the rows ([1, heads, T, hd]), the layout the prompt kernels read.
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs, a = [], 0
        for i, slot in enumerate(self.slots):
            b = a + slot.count
            if self.prompt_attention == "fused":
                new_k, new_v = k[a:b].contiguous(), v[a:b].contiguous()  # [count, kv_heads, hd]
                self._kv[i].append(torch.stack([new_k.transpose(0, 1), new_v.transpose(0, 1)]))
                keys, values = new_k.transpose(0, 1).unsqueeze(0), new_v.transpose(0, 1).unsqueeze(0)
                outs.append(self.backend.prompt_fused(qh[:, :, a:b], keys, values, scale))
            else:
                self._kv[i].append(torch.stack([kh[0, :, a:b], vh[0, :, a:b]]))
                keys, values = kh[:, :, a:b], vh[:, :, a:b]
                if slot.start:
                    assert self.cache is not None, "checked at construction"
                    old_k, old_v = self.cache.layer_kv(layer, slot.blocks, slot.start)
                    keys = torch.cat([old_k.unsqueeze(0), keys], dim=2)
                    values = torch.cat([old_v.unsqueeze(0), values], dim=2)
                outs.append(
                    self.backend.prompt_rows(
                        qh[:, :, a:b], keys.contiguous(), values.contiguous(), scale, slot.start
                    )
                )
            a = b
        return torch.cat(outs)

    def prompt_kv(self, index: int) -> torch.Tensor:
        """The KV a prefill pass computed for sequence `index`: [layers, 2, kv_heads, count, hd]."""
        if self.decode:
            raise ValueError("a decode step writes its KV into the cache itself")
        return torch.stack(self._kv[index]).contiguous()
