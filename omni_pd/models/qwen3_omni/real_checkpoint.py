"""Write a random checkpoint at Qwen3-Omni-30B-A3B's shapes (real_config.py), part by part.

The published checkpoint is bf16, in shards named by `model.safetensors.index.json`, with each
MoE expert stored as its own `experts.N.{gate,up,down}_proj.weight` (transformers fuses them when
it loads, and so does omni-pd's lean loader). This writer does the same, one part at a time
(thinker, talker, code2wav), so that it never holds more than one part: each part is built by
transformers uninitialised, its large weights filled from a seeded pool of normal values and the
rest initialised by transformers' own rules (`_build_part`), cast to bf16 and written into shards of at most `max_shard_size` bytes.

Before writing, `plan` counts what each part holds (built on the meta device: no memory) and what
each stage needs to load it; the writer refuses, with those numbers, on a host that cannot hold
the largest part while it is built.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.initialization import no_init_weights
from transformers import (
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeTalkerForConditionalGeneration,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from .real_config import real_config_dict, stack_layers
from .tokenizer import build_tiny_tokenizer

_PARTS = {
    "thinker": (Qwen3OmniMoeThinkerForConditionalGeneration, "thinker_config"),
    "talker": (Qwen3OmniMoeTalkerForConditionalGeneration, "talker_config"),
    "code2wav": (Qwen3OmniMoeCode2Wav, "code2wav_config"),
}
GiB = 2**30


@dataclass(frozen=True)
class PartPlan:
    part: str
    parameters: int
    bytes_bf16: int  # on disk
    build_bytes: int  # while it is built: float32, then its bf16 copy


@dataclass(frozen=True)
class WritePlan:
    layers: dict[str, int]
    parts: list[PartPlan]

    @property
    def disk_bytes(self) -> int:
        return sum(p.bytes_bf16 for p in self.parts)

    @property
    def peak_bytes(self) -> int:
        return max(p.build_bytes for p in self.parts)

    def stage_bytes(self, dtype_size: int) -> dict[str, int]:
        """What each stage's weights take once loaded at `dtype_size` bytes per value (the
        talker also loads the thinker's token embedding)."""
        by_part = {p.part: p.parameters for p in self.parts}
        embedding = self.embedding_parameters
        return {
            "thinker": by_part["thinker"] * dtype_size,
            "talker": (by_part["talker"] + embedding) * dtype_size,
            "code2wav": by_part["code2wav"] * dtype_size,
        }

    embedding_parameters: int = 0

    def describe(self) -> str:
        lines = [
            f"  {p.part:9s} {p.parameters / 1e9:6.2f} B parameters, {p.bytes_bf16 / GiB:6.2f} GiB bf16"
            for p in self.parts
        ]
        stages = self.stage_bytes(4)
        lines.append(
            f"  writing needs {self.peak_bytes / GiB:.2f} GiB of memory (the largest part built in "
            f"float32 and cast), {self.disk_bytes / GiB:.2f} GiB of disk"
        )
        lines.append(
            "  each stage loads its part: "
            + ", ".join(
                f"{stage} {size / GiB:.2f} GiB in float32 ({size / 2 / GiB:.2f} GiB in bf16)"
                for stage, size in stages.items()
            )
        )
        return "\n".join(lines)


def _part_config(config: Qwen3OmniMoeConfig, part: str):
    return getattr(config, _PARTS[part][1])


def plan(layers: int) -> WritePlan:
    """What a checkpoint with `layers` layers per stack holds and needs (no memory used)."""
    config = Qwen3OmniMoeConfig(**real_config_dict(layers))
    parts = []
    embedding = 0
    for part, (cls, _) in _PARTS.items():
        with torch.device("meta"):
            module = cls(_part_config(config, part))
        count = sum(p.numel() for p in module.parameters())
        if part == "thinker":
            embedding = module.get_input_embeddings().weight.numel()
        parts.append(PartPlan(part, count, 2 * count, 4 * count + 2 * count))
    return WritePlan(stack_layers(layers), parts, embedding_parameters=embedding)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# Tensors this large (elements) are filled from a seeded pool of normal values instead of drawn
# one by one: drawing 1.7 G normals took ~20 of the writer's ~27 s on 2 cores; copying from a
# pool is memory-bound. A pool of a prime length keeps neighbouring rows different.
_BIG = 1 << 20
_POOL = 16_777_259  # a prime just above 2**24


def _pool(seed: int, part: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(part.encode())) % (2**63))
    return torch.randn(_POOL, generator=generator)


def _fill(tensor: torch.Tensor, pool: torch.Tensor, start: int, std: float) -> None:
    """Normal(0, std) values for `tensor`: the pool's, read cyclically from `start`."""
    flat = tensor.view(-1)
    at, src = 0, start % pool.numel()
    while at < flat.numel():
        n = min(pool.numel() - src, flat.numel() - at)
        flat[at : at + n].copy_(pool[src : src + n])
        at, src = at + n, 0
    flat.mul_(std)


@torch.no_grad()
def _build_part(config: Qwen3OmniMoeConfig, part: str, seed: int) -> dict[str, torch.Tensor]:
    """The part's tensors, bf16, named as the published checkpoint names them (experts unfused).
    Built uninitialised; every large weight (linears, embeddings, convolutions, experts: the ones
    transformers draws from normal(0, initializer_range)) and every MoE router filled from the
    seeded pool and marked initialised, then transformers' own initialisation does the rest (norms, biases, routers,
    rotary and codec buffers) and skips the marked ones."""
    cls, _ = _PARTS[part]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 7919 + zlib.crc32(part.encode())) % (2**63))
        with no_init_weights():
            module = cls(_part_config(config, part)).eval()
        pool = _pool(seed, part)
        std = module.config.initializer_range or 0.02
        for name, param in module.named_parameters():
            # The routers too, at any size: transformers leaves the talker's at zero.
            if param.numel() >= _BIG or name.endswith(".mlp.gate.weight") or ".experts." in name:
                _fill(param.data, pool, zlib.crc32(name.encode()), std)
                param._is_hf_initialized = True
        # torch's own layers (Linear, Conv, Embedding, LayerNorm...) initialise through nn.init,
        # which no_init_weights skipped: their memory is empty until transformers' rules set it.
        # Marked NaN here, so that one those rules miss is an error, not garbage in the file.
        unset = {
            f"{prefix}.{name}" if prefix else name: param
            for prefix, sub in module.named_modules()
            if hasattr(sub, "reset_parameters")
            for name, param in sub.named_parameters(recurse=False)
            if not getattr(param, "_is_hf_initialized", False)
        }
        for param in unset.values():
            param.data.fill_(math.nan)
        module.init_weights()
    for name, param in unset.items():
        if not torch.isfinite(param).all():
            raise RuntimeError(f"{part}.{name}: transformers' initialisation left it unset")
    tensors: dict[str, torch.Tensor] = {}
    for name, param in module.state_dict().items():
        key = f"{part}.{name}"
        if name.endswith("mlp.experts.gate_up_proj"):
            half = param.shape[1] // 2
            stem = key[: -len("gate_up_proj")]
            for e in range(param.shape[0]):
                tensors[f"{stem}{e}.gate_proj.weight"] = param[e, :half].to(torch.bfloat16).contiguous()
                tensors[f"{stem}{e}.up_proj.weight"] = param[e, half:].to(torch.bfloat16).contiguous()
            continue
        if name.endswith("mlp.experts.down_proj"):
            stem = key[: -len("down_proj")]
            for e in range(param.shape[0]):
                tensors[f"{stem}{e}.down_proj.weight"] = param[e].to(torch.bfloat16).contiguous()
            continue
        tensors[key] = param.to(torch.bfloat16).contiguous()
    del module
    return tensors


def save_real_model(
    directory: str | os.PathLike,
    layers: int,
    seed: int = 0,
    max_shard_size: int = 4 * GiB,
    log=print,
) -> Path:
    """Write the checkpoint (config.json, the tiny tokenizer, bf16 shards and their index)."""
    work = plan(layers)
    log(
        f"the real-shape Qwen3-Omni checkpoint with {layers} layer(s) per stack ({work.layers}):\n"
        + work.describe()
    )
    free = available_memory()
    if free is not None and work.peak_bytes > free:
        raise MemoryError(
            f"writing it needs {work.peak_bytes / GiB:.2f} GiB of memory and this host has "
            f"{free / GiB:.2f} GiB available: ask for fewer layers (--layers), or run it on a larger host"
        )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3OmniMoeConfig(**real_config_dict(layers))
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, temporary = 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"shard-{len(temporary):05d}.tmp"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            temporary.append((name, list(shard)))
            shard, shard_bytes = {}, 0

    for part in _PARTS:
        for key, tensor in _build_part(config, part, seed).items():
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > max_shard_size:
                flush()
            shard[key] = tensor
            shard_bytes += size
        flush()  # a shard holds one part's tensors: a stage reads only its part's shards
    total = len(temporary)
    for index, (name, keys) in enumerate(temporary, start=1):
        final = f"model-{index:05d}-of-{total:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update({key: final for key in keys})
    (out / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": work.disk_bytes}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2,
        )
    )
    config.save_pretrained(str(out))
    build_tiny_tokenizer().save_pretrained(str(out))
    log(f"wrote {total} shard(s), {work.disk_bytes / GiB:.2f} GiB, into {out}")
    return out
