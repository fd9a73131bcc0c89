"""Write a random checkpoint at Qwen3-Omni-30B-A3B's shapes (real_config.py), part by part, with
the shared writer (models/random_checkpoint.py).

The published checkpoint stores each MoE expert as its own `experts.N.{gate,up,down}_proj.weight`
(transformers fuses them when it loads, and so does omni-pd's lean loader): this writer unfuses
them the same way. The routers are filled from the seeded pool too, at any size: transformers
leaves the talker's at zero.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeTalkerForConditionalGeneration,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from .. import random_checkpoint as rc
from ..random_checkpoint import GiB, Part, WritePlan
from .real_config import real_config_dict, stack_layers
from .tokenizer import build_tiny_tokenizer

PARTS = (
    Part("thinker", Qwen3OmniMoeThinkerForConditionalGeneration, "thinker_config"),
    Part("talker", Qwen3OmniMoeTalkerForConditionalGeneration, "talker_config"),
    Part("code2wav", Qwen3OmniMoeCode2Wav, "code2wav_config"),
)
available_memory = rc.available_memory  # here, so that a test can stand in for the host's


def plan(layers: int) -> WritePlan:
    """What a checkpoint with `layers` layers per stack holds and needs (no memory used)."""
    return rc.plan(
        Qwen3OmniMoeConfig(**real_config_dict(layers)),
        PARTS,
        stack_layers(layers),
        {"thinker": "thinker", "talker": "talker", "code2wav": "code2wav"},
        embedding_from=("talker", "thinker"),
    )


def _is_router(name: str) -> bool:
    return name.endswith(".mlp.gate.weight") or ".experts." in name


def _tensors(config: Qwen3OmniMoeConfig, part: Part, seed: int) -> dict[str, torch.Tensor]:
    """The part's tensors, bf16, named as the published checkpoint names them (experts unfused)."""
    tensors: dict[str, torch.Tensor] = {}
    for key, param in rc.bf16_tensors(part.name, rc.build_part(config, part, seed, _is_router)).items():
        if key.endswith("mlp.experts.gate_up_proj"):
            half = param.shape[1] // 2
            stem = key[: -len("gate_up_proj")]
            for e in range(param.shape[0]):
                tensors[f"{stem}{e}.gate_proj.weight"] = param[e, :half].contiguous()
                tensors[f"{stem}{e}.up_proj.weight"] = param[e, half:].contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            stem = key[: -len("down_proj")]
            for e in range(param.shape[0]):
                tensors[f"{stem}{e}.down_proj.weight"] = param[e].contiguous()
        else:
            tensors[key] = param
    return tensors


def save_real_model(
    directory: str | os.PathLike,
    layers: int,
    seed: int = 0,
    max_shard_size: int = 4 * GiB,
    log=print,
) -> Path:
    """Write the checkpoint (config.json, the tiny tokenizer, bf16 shards and their index)."""
    config = Qwen3OmniMoeConfig(**real_config_dict(layers))
    out = rc.write_checkpoint(
        directory,
        f"the real-shape Qwen3-Omni checkpoint with {layers} layer(s) per stack",
        plan(layers),
        config,
        (_tensors(config, part, seed) for part in PARTS),
        build_tiny_tokenizer(),
        max_shard_size,
        available_memory(),
        log,
    )
    return out
