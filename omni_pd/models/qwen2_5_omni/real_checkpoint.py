"""Write a random checkpoint at Qwen2.5-Omni-7B's shapes (real_config.py), part by part, with the
shared writer (models/random_checkpoint.py): thinker, talker and token2wav in bf16 shards named as
the published checkpoint names them, config.json, the tiny tokenizer and `spk_dict.pt` (two
voices of the published shapes).

As in the tiny model, the vocoder's convolutions are drawn again with a gain that keeps its
output audible (factory.audible_vocoder): transformers' initialisation leaves it near silence.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    Qwen2_5OmniConfig,
    Qwen2_5OmniTalkerForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniToken2WavModel,
)

from .. import random_checkpoint as rc
from ..random_checkpoint import GiB, Part, WritePlan
from .factory import SPEAKERS_FILE, audible_vocoder, seeded_speakers
from .real_config import REF_MEL_FRAMES, SPEAKER_EMBEDDING, real_config_dict, stack_layers
from .tokenizer import build_tiny_tokenizer

PARTS = (
    Part("thinker", Qwen2_5OmniThinkerForConditionalGeneration, "thinker_config"),
    Part("talker", Qwen2_5OmniTalkerForConditionalGeneration, "talker_config"),
    Part("token2wav", Qwen2_5OmniToken2WavModel, "token2wav_config"),
)
available_memory = rc.available_memory  # here, so that a test can stand in for the host's


def plan(layers: int) -> WritePlan:
    """What a checkpoint with `layers` layers per stack holds and needs (no memory used)."""
    return rc.plan(
        Qwen2_5OmniConfig(**real_config_dict(layers)),
        PARTS,
        stack_layers(layers),
        {"thinker": "thinker", "talker": "talker", "code2wav": "token2wav"},
        embedding_from=("talker", "thinker"),
    )


def _tensors(config: Qwen2_5OmniConfig, part: Part, seed: int) -> dict[str, torch.Tensor]:
    module = rc.build_part(config, part, seed)
    if part.name == "token2wav":
        audible_vocoder(module, seed)
    return rc.bf16_tensors(part.name, module)


def save_real_model(
    directory: str | os.PathLike,
    layers: int,
    seed: int = 0,
    max_shard_size: int = 4 * GiB,
    log=print,
) -> Path:
    """Write the checkpoint (config.json, the tiny tokenizer, voices, bf16 shards and index)."""
    config = Qwen2_5OmniConfig(**real_config_dict(layers))
    out = rc.write_checkpoint(
        directory,
        f"the real-shape Qwen2.5-Omni checkpoint with {layers} layer(s) per stack",
        plan(layers),
        config,
        (_tensors(config, part, seed) for part in PARTS),
        build_tiny_tokenizer(),
        max_shard_size,
        available_memory(),
        log,
    )
    torch.save(seeded_speakers(seed, SPEAKER_EMBEDDING, REF_MEL_FRAMES), out / SPEAKERS_FILE)
    return out
