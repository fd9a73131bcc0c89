"""The modules one hf stage runs, loaded lean from a checkpoint or cut from a whole model.

A stage builds only its own sub-model from its sub-config, on the `meta` device (no memory,
no initialisation), then fills it with its tensors from the checkpoint (`checkpoint.read_plan`):
  thinker   `Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config)` <- `thinker.*`
  talker    `Qwen3OmniMoeTalkerForConditionalGeneration(talker_config)`   <- `talker.*`, plus the
            thinker's token embedding (`thinker.model.embed_tokens.weight`) for the tts specials
  code2wav  `Qwen3OmniMoeCode2Wav(code2wav_config)`                       <- `code2wav.*`
As transformers' `from_pretrained` does: MoE experts stored one per module (`experts.N.gate_proj`)
are fused into the model's `gate_up_proj` / `down_proj`, tied weights absent from the checkpoint
are tied, and non-persistent buffers (rotary `inv_freq`, position tables, code offsets) are
recomputed by the model's own weight init, which skips every tensor that was loaded.

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

from .checkpoint import CheckpointError, LoadReport, Piece, ShardIndex, TensorPlan, read_plan

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
    with torch.device("meta"):
        return cls._from_config(getattr(config, key), dtype=dtype)


def part_plan(module: torch.nn.Module, prefix: str, index: ShardIndex) -> tuple[TensorPlan, set[str]]:
    """The checkpoint tensors filling `module` (named `prefix` + its state_dict keys), and the
    tied keys the checkpoint leaves out (tied after loading, as transformers does)."""
    plan, tied_absent = TensorPlan(), set()
    tied = getattr(module, "all_tied_weights_keys", None) or {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        name = prefix + key
        if key in tied and name not in index.weight_map:
            tied_absent.add(key)
            continue
        fused = next((f for f in _FUSED_EXPERTS if key.endswith(f)), None)
        if fused is not None and name not in index.weight_map:
            pieces = _expert_pieces(name, fused, tensor.shape)
        else:
            pieces = [Piece(name)]
        plan.add(key, tensor.shape, tensor.dtype, pieces)
    return plan, tied_absent


def _expert_pieces(name: str, fused: str, shape: torch.Size) -> list[Piece]:
    # As transformers' qwen2_moe conversion: gate_up_proj[e] = cat(gate_proj[e], up_proj[e]) on
    # dim 0; down_proj[e] = experts.e.down_proj.
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
    module = empty_part(config, part, dtype)
    plan, tied_absent = part_plan(module, f"{part}.", index)
    tensors, report = read_plan(index, plan, part)
    module.load_state_dict(tensors, strict=False, assign=True)
    for tensor in module.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True  # the weight init below must leave loaded tensors alone
    if tied_absent:
        module.tie_weights(missing_keys=tied_absent, recompute_mapping=False)
    _materialise_buffers(module)
    left = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(
            f"{index.source}: the {part} part has no values for {left[:5]}; the "
            "checkpoint does not match its config.json"
        )
    return module.eval(), report


@torch.no_grad()
def _materialise_buffers(module: torch.nn.Module) -> None:
    """Non-persistent buffers are not in checkpoints: allocate them and let the model's weight
    init compute them (the only tensors it touches: every loaded one is marked initialised)."""
    for owner in module.modules():
        for name, buffer in list(owner._buffers.items()):
            if buffer is not None and buffer.is_meta:
                owner._buffers[name] = torch.empty_like(buffer, device="cpu")
    module.initialize_weights()


def load_thinker_embedding(
    index: ShardIndex, config: Qwen3OmniMoeConfig, dtype: torch.dtype
) -> tuple[torch.nn.Embedding, LoadReport]:
    text = config.thinker_config.text_config
    with torch.device("meta"):
        embedding = torch.nn.Embedding(text.vocab_size, text.hidden_size, dtype=dtype)
    plan = TensorPlan()
    plan.add("weight", embedding.weight.shape, dtype, [Piece(THINKER_EMBEDDING)])
    tensors, report = read_plan(index, plan, "thinker embedding")
    embedding.load_state_dict(tensors, assign=True)
    return embedding.eval(), report


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
