"""The modules one Qwen2.5-Omni hf stage runs, loaded lean from a checkpoint (models/lean_load.py)
or cut from a whole model:
  thinker   `Qwen2_5OmniThinkerForConditionalGeneration(thinker_config)` <- `thinker.*`
  talker    `Qwen2_5OmniTalkerForConditionalGeneration(talker_config)`   <- `talker.*`, plus the
            thinker's token embedding (`thinker.model.embed_tokens.weight`): the talker's input
            adds the embedding of each token the thinker wrote
  code2wav  `Qwen2_5OmniToken2WavModel(token2wav_config)`                <- `token2wav.*`, in
            float32 whatever the stage's dtype, as transformers' `enable_talker` keeps it

`load_format: dummy` still builds the whole seeded model (tiny; its bytes depend on building all
parts in order) and keeps only the stage's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    Qwen2_5OmniConfig,
    Qwen2_5OmniTalkerForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniToken2WavModel,
)

from ..checkpoint import LoadReport, ShardIndex
from ..lean_load import empty_module, load_embedding, load_module

PARTS = ("thinker", "talker", "code2wav")
THINKER_EMBEDDING = "thinker.model.embed_tokens.weight"
# part -> (class, sub-config, checkpoint prefix)
_CLASSES = {
    "thinker": (Qwen2_5OmniThinkerForConditionalGeneration, "thinker_config", "thinker."),
    "talker": (Qwen2_5OmniTalkerForConditionalGeneration, "talker_config", "talker."),
    "code2wav": (Qwen2_5OmniToken2WavModel, "token2wav_config", "token2wav."),
}


@dataclass
class StageParts:
    """What one stage's engine runs; the parts other stages run are None."""

    config: Qwen2_5OmniConfig
    thinker: torch.nn.Module | None = None
    talker: torch.nn.Module | None = None
    token2wav: torch.nn.Module | None = None
    thinker_embedding: torch.nn.Module | None = None  # the talker's view of the thinker's tokens

    @classmethod
    def of(cls, model, stage: str) -> "StageParts":
        """The parts `stage` runs, cut from a whole model."""
        if stage not in PARTS:
            raise ValueError(f"model_stage {stage!r} is not one of {PARTS}")
        return cls(
            config=model.config,
            thinker=model.thinker if stage == "thinker" else None,
            talker=model.talker if stage == "talker" else None,
            token2wav=model.token2wav if stage == "code2wav" else None,
            thinker_embedding=model.thinker.get_input_embeddings() if stage == "talker" else None,
        )

    def require(self, part: str) -> torch.nn.Module:
        module = getattr(self, part)
        if module is None:
            raise ValueError(f"these stage parts hold no {part} (loaded for another stage)")
        return module


def load_stage_parts(
    index: ShardIndex, config: Qwen2_5OmniConfig, stage: str, dtype: torch.dtype
) -> tuple[StageParts, list[LoadReport]]:
    """The modules `stage` runs, read from the checkpoint; nothing of the other parts."""
    if stage not in PARTS:
        raise ValueError(f"model_stage {stage!r} is not one of {PARTS}")
    cls, key, prefix = _CLASSES[stage]
    part_dtype = torch.float32 if stage == "code2wav" else dtype
    module, report = load_module(index, empty_module(cls, getattr(config, key), part_dtype), prefix, stage)
    reports = [report]
    parts = StageParts(config=config, **{"token2wav" if stage == "code2wav" else stage: module})
    if stage == "talker":
        text = config.thinker_config.text_config
        parts.thinker_embedding, extra = load_embedding(
            index, THINKER_EMBEDDING, text.vocab_size, text.hidden_size, dtype, "thinker embedding"
        )
        reports.append(extra)
    return parts, reports
