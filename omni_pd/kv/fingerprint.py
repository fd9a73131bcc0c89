"""KV fingerprints: what a prefill and a decode engine must share for one's KV to mean the same
thing to the other (model, weights, dtype, KV geometry), plus facts about the layout that the
handoff converts (block size, block layout) and the engine's id.

Each engine logs its fingerprint at start-up; the prefill engine sends it with every descriptor
and the decode engine compares it with its own on the first transfer from each remote engine.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Mapping

import torch
import xxhash

from .errors import KVIncompatibleError
from .layout import BlockLayout

FINGERPRINT_KEY = "kv_fingerprint"  # its key in kv_transfer_params, beside vLLM's keys
# Fields that may differ between peers: the receiver converts block size and layout (layout.py).
CONVERTED_FIELDS = frozenset({"block_size", "kv_layout"})
IGNORED_FIELDS = frozenset({"engine_id"})

FULL_HASH_LIMIT_BYTES = 50 * 2 ** 20
SAMPLE_BYTES = 64 * 2 ** 10


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A short xxhash of a model's weights, cheap enough for start-up. Up to 50 MiB of weights:
    every byte. Above: names, shapes, dtypes and the first 64 KiB of each tensor, which tells
    apart different checkpoints, seeds and dtypes without reading (or copying off the GPU)
    tens of GiB."""
    tensors = list(named_tensors)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    limit = None if total <= FULL_HASH_LIMIT_BYTES else SAMPLE_BYTES
    digest = xxhash.xxh3_64()
    for name, tensor in tensors:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        raw = tensor.detach().reshape(-1).view(torch.uint8)  # bf16 has no numpy dtype: use bytes
        if limit is not None:
            raw = raw[:limit]
        digest.update(raw.cpu().contiguous().numpy())
    return f"{'full' if limit is None else 'sampled'}:{digest.hexdigest()}"


def kv_fingerprint(model: str, weights: str, layout: BlockLayout, engine_id: str) -> dict[str, Any]:
    """Plain data (it travels in kv_transfer_params)."""
    return {"model": model, "weights": weights, "dtype": layout.dtype,
            "block_size": layout.block_size, "kv_layout": layout.to_dict(),
            "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "engine_id": engine_id}


def incompatible_fields(local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[str]:
    """Fields (sorted) whose values differ, or that only one side has, ignoring the engine id
    and what the handoff converts."""
    skip = IGNORED_FIELDS | CONVERTED_FIELDS
    keys = (set(local) | set(remote)) - skip
    return sorted(k for k in keys if local.get(k, _MISSING) != remote.get(k, _MISSING))


_MISSING = object()


def _shown(value: Any) -> str:
    return "<missing>" if value is _MISSING else repr(value)


class PeerFingerprints:
    """Checks each remote engine's fingerprint against this engine's once: remote engine ids
    whose fingerprint matched are remembered (the most recent `capacity` of them); a peer that
    comes back under the same id with another fingerprint is checked again."""

    def __init__(self, local: Mapping[str, Any], capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.local, self.capacity = dict(local), capacity
        self._verified: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def is_verified(self, engine_id: str) -> bool:
        with self._lock:
            return engine_id in self._verified

    def check(self, engine_id: str, remote: Mapping[str, Any] | None) -> None:
        """Raise KVIncompatibleError unless `remote` (the fingerprint the peer sent) matches."""
        with self._lock:
            if engine_id in self._verified and self._verified[engine_id] == remote:
                self._verified.move_to_end(engine_id)
                return
        if not isinstance(remote, Mapping):
            raise KVIncompatibleError(
                f"prefill engine {engine_id} sent no {FINGERPRINT_KEY} (got {type(remote).__name__}) "
                f"in kv_transfer_params; decode engine {self.local.get('engine_id')} refuses KV it "
                "cannot check: run omni-pd's prefill engine on the prefill stage")
        differing = incompatible_fields(self.local, remote)
        if differing:
            details = "; ".join(f"{k}: prefill {_shown(remote.get(k, _MISSING))}, decode "
                                f"{_shown(self.local.get(k, _MISSING))}" for k in differing)
            raise KVIncompatibleError(
                f"prefill engine {engine_id} and decode engine {self.local.get('engine_id')} are "
                f"incompatible, their KV would be misread: {details}. Both stages must load the "
                "same model and weights (engine_args load_format, seed) with the same dtype")
        with self._lock:
            self._verified[engine_id] = dict(remote)
            self._verified.move_to_end(engine_id)
            while len(self._verified) > self.capacity:
                self._verified.popitem(last=False)
