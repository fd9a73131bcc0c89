"""Write a random checkpoint at a real model's shapes, part by part (any model: its package names
the parts). What `make-tiny-model --size real` writes for each model that has a real-shape config.

The published omni checkpoints are bf16, in shards named by `model.safetensors.index.json`. The
writer does the same, one part at a time (e.g. thinker, talker, code2wav), so that it never holds
more than one part: each part is built by transformers uninitialised, its large weights filled
from a seeded pool of normal values and the rest initialised by transformers' own rules
(`build_part`), cast to bf16 and written into shards of at most `max_shard_size` bytes. A shard
holds one part's tensors, so a stage reads only its part's shards.

Before writing, `plan` counts what each part holds (built on the meta device: no memory); the
writer refuses, with those numbers, on a host that cannot hold the largest part while it is built.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors.torch import save_file
from transformers.initialization import no_init_weights

from .checkpoint import INDEX_FILE

GiB = 2**30


@dataclass(frozen=True)
class Part:
    """One part of the checkpoint: its tensors are `<name>.<module's own names>`."""

    name: str
    cls: type
    config_attr: str  # the sub-config of the whole model's config it is built from


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
    # stage -> (the part it loads, parameters it loads besides: e.g. the thinker's embedding)
    stages: dict[str, tuple[str, int]]

    @property
    def disk_bytes(self) -> int:
        return sum(p.bytes_bf16 for p in self.parts)

    @property
    def peak_bytes(self) -> int:
        return max(p.build_bytes for p in self.parts)

    def stage_bytes(self, dtype_size: int) -> dict[str, int]:
        """What each stage's weights take once loaded at `dtype_size` bytes per value."""
        by_part = {p.part: p.parameters for p in self.parts}
        return {stage: (by_part[part] + extra) * dtype_size for stage, (part, extra) in self.stages.items()}

    def describe(self) -> str:
        lines = [
            f"  {p.part:9s} {p.parameters / 1e9:6.2f} B parameters, {p.bytes_bf16 / GiB:6.2f} GiB bf16"
            for p in self.parts
        ]
        lines.append(
            f"  writing needs {self.peak_bytes / GiB:.2f} GiB of memory (the largest part built in "
            f"float32 and cast), {self.disk_bytes / GiB:.2f} GiB of disk"
        )
        lines.append(
            "  each stage loads its part: "
            + ", ".join(
                f"{stage} {size / GiB:.2f} GiB in float32 ({size / 2 / GiB:.2f} GiB in bf16)"
                for stage, size in self.stage_bytes(4).items()
            )
        )
        return "\n".join(lines)


def meta_parts(config: Any, parts: Iterable[Part]) -> dict[str, torch.nn.Module]:
    """Each part built on the meta device (no memory): what `plan` counts."""
    out = {}
    for part in parts:
        with torch.device("meta"):
            out[part.name] = part.cls(getattr(config, part.config_attr))
    return out


def part_plans(modules: dict[str, torch.nn.Module]) -> list[PartPlan]:
    plans = []
    for name, module in modules.items():
        count = sum(p.numel() for p in module.parameters())
        plans.append(PartPlan(name, count, 2 * count, 4 * count + 2 * count))
    return plans


def plan(
    config: Any,
    parts: Iterable[Part],
    layers: dict[str, int],
    stage_parts: dict[str, str],
    embedding_from: tuple[str, str] | None = None,
) -> WritePlan:
    """What a checkpoint of `parts` holds and needs (no memory used). Each stage loads its part
    (`stage_parts`); with `embedding_from` (stage, part) that stage also loads the part's token
    embedding (an omni talker reads the thinker's)."""
    modules = meta_parts(config, parts)
    stages = {stage: (part, 0) for stage, part in stage_parts.items()}
    if embedding_from is not None:
        stage, part = embedding_from
        stages[stage] = (stages[stage][0], modules[part].get_input_embeddings().weight.numel())
    return WritePlan(layers, part_plans(modules), stages)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(work: WritePlan, free: int | None) -> None:
    if free is not None and work.peak_bytes > free:
        raise MemoryError(
            f"writing it needs {work.peak_bytes / GiB:.2f} GiB of memory and this host has "
            f"{free / GiB:.2f} GiB available: ask for fewer layers (--layers), or run it on a larger host"
        )


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
def build_part(
    config: Any, part: Part, seed: int, also_fill: Callable[[str], bool] = lambda name: False
) -> torch.nn.Module:
    """The part in float32, seeded. Built uninitialised; every large weight (linears, embeddings,
    convolutions: the ones transformers draws from normal(0, initializer_range)) and each one
    `also_fill` names filled from the seeded pool and marked initialised, then transformers' own
    initialisation does the rest (norms, biases, buffers) and skips the marked ones."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 7919 + zlib.crc32(part.name.encode())) % (2**63))
        with no_init_weights():
            module = part.cls(getattr(config, part.config_attr)).eval()
        pool = _pool(seed, part.name)
        std = getattr(module.config, "initializer_range", None) or 0.02
        for name, param in module.named_parameters():
            if param.numel() >= _BIG or also_fill(name):
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
            raise RuntimeError(f"{part.name}.{name}: transformers' initialisation left it unset")
    return module


def bf16_tensors(part: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state as the checkpoint names it (`<part>.<name>`), in bf16."""
    return {f"{part}.{name}": t.to(torch.bfloat16).contiguous() for name, t in module.state_dict().items()}


def write_shards(
    out: Path, parts: Iterable[dict[str, torch.Tensor]], total_size: int, max_shard_size: int
) -> int:
    """Each part's tensors into shards of at most `max_shard_size` bytes (a shard never mixes
    parts), named as save_pretrained names them, and the index; returns the shard count."""
    temporary: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"shard-{len(temporary):05d}.tmp"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            temporary.append((name, list(shard)))
            shard, shard_bytes = {}, 0

    for tensors in parts:
        for key, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > max_shard_size:
                flush()
            shard[key] = tensor
            shard_bytes += size
        flush()
        del tensors  # before the next part is built: one part in memory at a time
    weight_map: dict[str, str] = {}
    total = len(temporary)
    for index, (name, keys) in enumerate(temporary, start=1):
        final = f"model-{index:05d}-of-{total:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update({key: final for key in keys})
    (out / INDEX_FILE).write_text(
        json.dumps(
            {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2,
        )
    )
    return total


def write_checkpoint(
    directory: str | Path,
    title: str,
    work: WritePlan,
    config: Any,
    parts: Iterable[dict[str, torch.Tensor]],
    tokenizer: Any,
    max_shard_size: int,
    free: int | None,
    log: Callable[[str], Any] = print,
) -> Path:
    """The plan said first, the host's memory checked against it (nothing written when short),
    then the shards (`parts` builds each part's tensors when asked), config.json and the tokenizer."""
    log(f"{title} ({work.layers}):\n" + work.describe())
    check_memory(work, free)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    total = write_shards(out, parts, work.disk_bytes, max_shard_size)
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    log(f"wrote {total} shard(s), {work.disk_bytes / GiB:.2f} GiB, into {out}")
    return out
