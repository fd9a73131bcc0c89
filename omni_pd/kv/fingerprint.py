"""KV fingerprints: what a prefill and a decode engine must share for one's KV to mean the same
thing to the other (model, weights, dtype, KV geometry), plus facts about the layout that the
handoff converts (block size, block layout), the engine's id, and what it computes with.

Each engine logs its fingerprint at start-up; the prefill engine sends it with every descriptor
and the decode engine compares it with its own on the first transfer from each remote engine.

The compute identity (`compute`: device, torch, its CPU level, native kernel builds) is checked
apart: engines that differ there read each other's KV correctly, but the prefill computed it with
other kernels, so its last bits differ from what the decode engine would compute, and P/D output
is no longer exactly colocated output. A mismatch is one WARNING at the first handoff from that
peer, naming both sides, or refused with `require_identical_kernels`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
import logging
from typing import Any, Iterable, Mapping

import torch
import xxhash

from .errors import KVIncompatibleError
from .layout import BlockLayout

FINGERPRINT_KEY = "kv_fingerprint"  # its key in kv_transfer_params, beside vLLM's keys
# Fields that may differ between peers: the receiver converts block size and layout (layout.py).
CONVERTED_FIELDS = frozenset({"block_size", "kv_layout"})
IGNORED_FIELDS = frozenset({"engine_id"})
COMPUTE_FIELD = "compute"  # checked apart: a mismatch warns, or refuses when asked to

log = logging.getLogger(__name__)

FULL_HASH_LIMIT_BYTES = 50 * 2**20
SAMPLE_BYTES = 64 * 2**10


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
        # numpy's stubs give ndarray its __buffer__ only for Python >= 3.12; it is a buffer here too.
        digest.update(raw.cpu().contiguous().numpy())  # type: ignore[arg-type]
    return f"{'full' if limit is None else 'sampled'}:{digest.hexdigest()}"


def kv_fingerprint(
    model: str, weights: str, layout: BlockLayout, engine_id: str, compute: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Plain data (it travels in kv_transfer_params)."""
    fingerprint = {
        "model": model,
        "weights": weights,
        "dtype": layout.dtype,
        "block_size": layout.block_size,
        "kv_layout": layout.to_dict(),
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "engine_id": engine_id,
    }
    if compute is not None:
        fingerprint[COMPUTE_FIELD] = dict(compute)
    return fingerprint


def incompatible_fields(local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[str]:
    """Fields (sorted) whose values differ, or that only one side has, ignoring the engine id,
    what the handoff converts and the compute identity."""
    skip = IGNORED_FIELDS | CONVERTED_FIELDS | {COMPUTE_FIELD}
    keys = (set(local) | set(remote)) - skip
    return sorted(k for k in keys if local.get(k, _MISSING) != remote.get(k, _MISSING))


def compute_differences(local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[str]:
    """What differs between two compute identities, one 'key: prefill X, decode Y' each
    (`remote` is the prefill's); [] when they match."""
    mine = local.get(COMPUTE_FIELD) or {}
    theirs = remote.get(COMPUTE_FIELD) or {}
    keys = sorted(set(mine) | set(theirs))
    return [
        f"{k}: prefill {_shown(theirs.get(k, _MISSING))}, decode {_shown(mine.get(k, _MISSING))}"
        for k in keys
        if mine.get(k, _MISSING) != theirs.get(k, _MISSING)
    ]


_MISSING = object()


def _shown(value: Any) -> str:
    return "<missing>" if value is _MISSING else repr(value)


class PeerFingerprints:
    """Checks each remote engine's fingerprint against this engine's once: remote engine ids
    whose fingerprint matched are remembered (the most recent `capacity` of them); a peer that
    comes back under the same id with another fingerprint is checked again."""

    def __init__(
        self, local: Mapping[str, Any], capacity: int = 256, require_identical_kernels: bool = False
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.local, self.capacity = dict(local), capacity
        self.require_identical_kernels = require_identical_kernels
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
                "cannot check: run omni-pd's prefill engine on the prefill stage"
            )
        differing = incompatible_fields(self.local, remote)
        if differing:
            details = "; ".join(
                f"{k}: prefill {_shown(remote.get(k, _MISSING))}, decode "
                f"{_shown(self.local.get(k, _MISSING))}"
                for k in differing
            )
            raise KVIncompatibleError(
                f"prefill engine {engine_id} and decode engine {self.local.get('engine_id')} are "
                f"incompatible, their KV would be misread: {details}. Both stages must load the "
                "same model and weights (engine_args load_format, seed) with the same dtype"
            )
        self._check_compute(engine_id, remote)
        with self._lock:
            self._verified[engine_id] = dict(remote)
            self._verified.move_to_end(engine_id)
            while len(self._verified) > self.capacity:
                self._verified.popitem(last=False)

    def _check_compute(self, engine_id: str, remote: Mapping[str, Any]) -> None:
        differing = compute_differences(self.local, remote)
        if not differing:
            return
        pair = (
            f"prefill engine {engine_id} and decode engine {self.local.get('engine_id')} compute "
            f"with different kernels ({'; '.join(differing)})"
        )
        if self.require_identical_kernels:
            raise KVIncompatibleError(
                f"{pair}, and kv_connector_extra_config.require_identical_kernels is true: run both "
                "stages with the same ATEN_CPU_CAPABILITY (runtime.env), device and native kernel "
                "build, or set require_identical_kernels: false to accept the pair"
            )
        log.warning(
            "%s: the prefill's KV differs in the last bits from what the decode engine "
            "would compute, so P/D output may differ from colocated output. Run both "
            "stages with the same ATEN_CPU_CAPABILITY (runtime.env), device and native "
            "kernel build, or set kv_connector_extra_config.require_identical_kernels: "
            "true to refuse such pairs",
            pair,
        )
