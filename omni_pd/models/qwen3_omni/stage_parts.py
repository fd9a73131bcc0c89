"""The modules one Qwen3-Omni hf stage runs, loaded lean from a checkpoint (models/lean_load.py)
or cut from a whole model:
  thinker   `Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config)` <- `thinker.*`
  talker    `Qwen3OmniMoeTalkerForConditionalGeneration(talker_config)`   <- `talker.*`, plus the
            thinker's token embedding (`thinker.model.embed_tokens.weight`) for the tts specials
  code2wav  `Qwen3OmniMoeCode2Wav(code2wav_config)`                       <- `code2wav.*`
MoE experts stored one per module (`experts.N.gate_proj`) are fused into the model's
`gate_up_proj` / `down_proj`, as transformers' `from_pretrained` does.

`load_format: dummy` still builds the whole seeded model (tiny; its bytes depend on building all
parts in order) and keeps only the stage's part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import (
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeTalkerForConditionalGeneration,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from ..checkpoint import LoadReport, Piece, ShardIndex
from ..lean_load import empty_module, load_embedding, load_module

log = logging.getLogger(__name__)

PARTS = ("thinker", "talker", "code2wav")
THINKER_EMBEDDING = "thinker.model.embed_tokens.weight"
_CLASSES = {
    "thinker": (Qwen3OmniMoeThinkerForConditionalGeneration, "thinker_config"),
    "talker": (Qwen3OmniMoeTalkerForConditionalGeneration, "talker_config"),
    "code2wav": (Qwen3OmniMoeCode2Wav, "code2wav_config"),
}
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass
class StageParts:
    """What one stage's engine runs; the parts other stages run are None."""

    config: Qwen3OmniMoeConfig
    thinker: torch.nn.Module | None = None
    talker: torch.nn.Module | None = None
    code2wav: torch.nn.Module | None = None
    thinker_embedding: torch.nn.Module | None = None  # the talker's tts_bos/eos/pad rows

    @classmethod
    def of(cls, model, stage: str | None = None) -> "StageParts":
        """A whole model's parts (all of them, or those `stage` runs); StageParts pass through."""
        if isinstance(model, StageParts):
            return model
        wanted = PARTS if stage is None else (stage,)
        return cls(
            config=model.config,
            thinker=model.thinker if "thinker" in wanted else None,
            talker=model.talker if "talker" in wanted else None,
            code2wav=model.code2wav if "code2wav" in wanted else None,
            thinker_embedding=(model.thinker.get_input_embeddings() if "talker" in wanted else None),
        )

    def to(self, device: torch.device | str) -> "StageParts":
        """The same parts moved to `device` (in place, as nn.Module.to)."""
        for name in (*PARTS, "thinker_embedding"):
            module = getattr(self, name)
            if module is not None:
                module.to(device)
        return self

    def require(self, part: str) -> torch.nn.Module:
        module = getattr(self, part)
        if module is None:
            raise ValueError(f"these stage parts hold no {part} (loaded for another stage)")
        return module


def empty_part(config: Qwen3OmniMoeConfig, part: str, dtype: torch.dtype) -> torch.nn.Module:
    """The part's module on the meta device: shapes only, no memory, no initialisation."""
    cls, key = _CLASSES[part]
    return empty_module(cls, getattr(config, key), dtype)


def _expert_pieces(name: str, key: str, shape: torch.Size) -> list[Piece] | None:
    # As transformers' qwen2_moe conversion: gate_up_proj[e] = cat(gate_proj[e], up_proj[e]) on
    # dim 0; down_proj[e] = experts.e.down_proj.
    fused = next((f for f in _FUSED_EXPERTS if key.endswith(f)), None)
    if fused is None:
        return None
    stem = name[: -len(fused)] + "mlp.experts."
    experts = shape[0]
    if fused.endswith("gate_up_proj"):
        half = shape[1] // 2
        return [
            piece
            for e in range(experts)
            for piece in (
                Piece(f"{stem}{e}.gate_proj.weight", (e, slice(0, half))),
                Piece(f"{stem}{e}.up_proj.weight", (e, slice(half, 2 * half))),
            )
        ]
    return [Piece(f"{stem}{e}.down_proj.weight", (e,)) for e in range(experts)]


def load_part(
    index: ShardIndex, config: Qwen3OmniMoeConfig, part: str, dtype: torch.dtype
) -> tuple[torch.nn.Module, LoadReport]:
    return load_module(index, empty_part(config, part, dtype), f"{part}.", part, _expert_pieces)


def load_thinker_embedding(
    index: ShardIndex, config: Qwen3OmniMoeConfig, dtype: torch.dtype
) -> tuple[torch.nn.Embedding, LoadReport]:
    text = config.thinker_config.text_config
    return load_embedding(
        index, THINKER_EMBEDDING, text.vocab_size, text.hidden_size, dtype, "thinker embedding"
    )


def load_stage_parts(
    index: ShardIndex, config: Qwen3OmniMoeConfig, stage: str, dtype: torch.dtype
) -> tuple[StageParts, list[LoadReport]]:
    """The modules `stage` runs, read from the checkpoint; nothing of the other parts."""
    if stage not in PARTS:
        raise ValueError(f"model_stage {stage!r} is not one of {PARTS}")
    module, report = load_part(index, config, stage, dtype)
    parts, reports = StageParts(config=config, **{stage: module}), [report]
    if stage == "talker":
        parts.thinker_embedding, extra = load_thinker_embedding(index, config, dtype)
        reports.append(extra)
    return parts, reports
