"""Read part of a sharded safetensors checkpoint: the shard index, and the named tensors.

A stage asks for the tensors of its part only (`TensorPlan`: each destination tensor and the
checkpoint tensors that fill it), and only the shards holding them are opened. Tensors are read
through `safetensors.safe_open` (memory-mapped) and copied into freshly allocated, aligned memory
in the stage's dtype: safetensors can map a tensor at a misaligned address, which changes the
last bit of some CPU kernels' results. A shard's mapping is dropped every `MAP_WINDOW_BYTES`
copied, so the mapped pages (which count in the process's RSS while mapped) stay a small window
on top of the part itself.

Every problem a user can fix is a `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Re-open a shard after this many bytes copied from it: bounds the mapped pages held at once.
MAP_WINDOW_BYTES = 32 * 2**20
# Checkpoint dtypes a floating-point parameter can be converted from.
_FLOAT_SOURCES = {"F64", "F32", "F16", "BF16"}
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint a stage cannot load; the message says what is wrong and what to change."""


@dataclass(frozen=True)
class ShardIndex:
    """Which shard file holds each tensor of a checkpoint directory."""

    directory: Path
    source: Path  # the index JSON, or the single model.safetensors
    weight_map: Mapping[str, str]  # tensor name -> shard file name (relative to directory)

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.weight_map.values())))


def read_shard_index(directory: str | Path) -> ShardIndex:
    """`model.safetensors.index.json`'s weight_map, or the tensors of a single `model.safetensors`."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            data = json.loads(index_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(
                f"{index_path} is not valid JSON ({exc}); re-write it (e.g. "
                "save_pretrained) or copy it again from the checkpoint"
            ) from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
        ):
            raise CheckpointError(
                f"{index_path} has no `weight_map` (a non-empty object of tensor "
                "name -> shard file); re-write the index or copy it again"
            )
        escaping = [v for v in set(weight_map.values()) if Path(v).name != v]
        if escaping:
            raise CheckpointError(
                f"{index_path}: weight_map names shard {escaping[0]!r}, which is "
                "not a file name in the checkpoint directory"
            )
        return ShardIndex(directory, index_path, dict(weight_map))
    single = directory / SINGLE_FILE
    if single.is_file():
        with _open(single) as handle:
            return ShardIndex(directory, single, {name: SINGLE_FILE for name in handle.keys()})
    raise CheckpointError(
        f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}: the hf stages "
        "load safetensors checkpoints (convert other formats with save_pretrained)"
    )


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"shard {path} is missing; copy it into the checkpoint directory again"
        ) from exc
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"shard {path} is not a readable safetensors file ({exc}); it may be "
            "truncated or corrupt: copy it again"
        ) from exc


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and where it goes in its destination (`index` into it; () = whole)."""

    name: str
    index: tuple = ()


@dataclass
class TensorPlan:
    """The destination tensors of one part (keyed by the module's state_dict names) and the
    checkpoint tensors that fill them."""

    shapes: dict[str, torch.Size] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    pieces: dict[str, list[Piece]] = field(default_factory=dict)

    def add(self, key: str, shape: torch.Size, dtype: torch.dtype, pieces: list[Piece]) -> None:
        self.shapes[key], self.dtypes[key], self.pieces[key] = shape, dtype, pieces


@dataclass(frozen=True)
class LoadReport:
    part: str
    tensors: int  # checkpoint tensors read
    bytes: int  # bytes of the destination tensors
    shards_read: tuple[str, ...]
    shards_total: int
    seconds: float


def read_plan(index: ShardIndex, plan: TensorPlan, part: str) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Read every piece of `plan` from the shards that hold them; returns the filled tensors."""
    began = time.perf_counter()
    by_shard: dict[str, list[tuple[str, Piece]]] = defaultdict(list)
    missing = []
    for key, pieces in plan.pieces.items():
        for piece in pieces:
            shard = index.weight_map.get(piece.name)
            if shard is None:
                missing.append(piece.name)
            else:
                by_shard[shard].append((key, piece))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"{index.source} lacks {len(missing)} tensor(s) of the {part} part: "
            f"{shown}; the checkpoint does not match its config.json (use the "
            "checkpoint's own config, or a complete checkpoint)"
        )
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(by_shard):
        _read_shard(index.directory / shard, by_shard[shard], plan, out)
    nbytes = sum(t.numel() * t.element_size() for t in out.values())
    report = LoadReport(
        part,
        sum(len(v) for v in by_shard.values()),
        nbytes,
        tuple(sorted(by_shard)),
        len(index.shards),
        time.perf_counter() - began,
    )
    return out, report


def _read_shard(
    path: Path, wanted: list[tuple[str, Piece]], plan: TensorPlan, out: dict[str, torch.Tensor]
) -> None:
    if not path.is_file():
        raise CheckpointError(
            f"shard {path} is missing (the index says it holds "
            f"{wanted[0][1].name}); copy it into the checkpoint directory again"
        )
    handle, mapped = _open(path), 0
    keys = set(handle.keys())
    try:
        for key, piece in wanted:
            if piece.name not in keys:
                raise CheckpointError(
                    f"shard {path} lacks {piece.name}, which the index says it "
                    "holds; the index and the shards do not match: copy both again"
                )
            if mapped >= MAP_WINDOW_BYTES:  # drop the mapped pages read so far
                del handle
                handle, mapped = _open(path), 0
            tensor = _read_piece(handle, path, key, piece, plan, out)
            mapped += tensor.numel() * tensor.element_size()
    finally:
        del handle
    log.debug("read %d tensors from %s", len(wanted), path.name)


def _read_piece(
    handle, path: Path, key: str, piece: Piece, plan: TensorPlan, out: dict[str, torch.Tensor]
) -> torch.Tensor:
    target = plan.dtypes[key]
    try:
        stored = handle.get_slice(piece.name).get_dtype()
    except SafetensorError as exc:
        raise CheckpointError(f"shard {path}: cannot read {piece.name} ({exc}); copy it again") from exc
    if target.is_floating_point and stored not in _FLOAT_SOURCES:
        raise CheckpointError(
            f"shard {path}: tensor {piece.name} is {stored}, which the hf stage "
            f"cannot use as {target} (quantized or non-float weights); use a "
            "checkpoint with float32, float16 or bfloat16 weights"
        )
    if not target.is_floating_point and _DTYPES.get(stored) != target:
        raise CheckpointError(f"shard {path}: tensor {piece.name} is {stored}, expected {target}")
    if key not in out:
        out[key] = torch.empty(plan.shapes[key], dtype=target)  # fresh, aligned, untouched
    dest = out[key][piece.index] if piece.index else out[key]
    try:
        source = handle.get_tensor(piece.name)
    except SafetensorError as exc:
        raise CheckpointError(
            f"shard {path}: cannot read {piece.name} ({exc}); the file may be "
            "truncated or corrupt: copy it again"
        ) from exc
    if tuple(source.shape) != tuple(dest.shape):
        raise CheckpointError(
            f"shard {path}: tensor {piece.name} has shape {tuple(source.shape)}, "
            f"the model needs {tuple(dest.shape)}; the checkpoint does not match "
            "its config.json"
        )
    dest.copy_(source)
    return source
