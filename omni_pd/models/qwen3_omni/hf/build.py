"""hf (transformers) engines for the three Qwen3-Omni stages: this package's runners, made by
`make_runner` for the one hf engine builder (engines/hf/builder.py)."""

from __future__ import annotations

import logging
from typing import Any

from ..factory import load_stage, load_tokenizer, resolve_model
from ..pipeline import thinker_eos_ids
from omni_pd.engines.base import StageEngine
from omni_pd.engines.core.runner import ArRunner, ChunkRunner
from omni_pd.engines.device import kernels_for
from omni_pd.engines.hf.builder import HfStage, build_hf_engine as build_engine
from ...lean_load import log_reports
from ..stage_parts import StageParts
from .code2wav_runner import Code2WavRunner
from .talker_model import TalkerModel
from .talker_runner import TalkerRunner
from .thinker_model import ThinkerModel
from .thinker_runner import ThinkerRunner

log = logging.getLogger(__name__)


def thinker_model(model, tokenizer) -> ThinkerModel:
    """`model`: a whole model or a thinker stage's StageParts."""
    parts = StageParts.of(model)
    config = parts.config
    return ThinkerModel(
        parts.require("thinker"),
        tokenizer,
        config.talker_config.accept_hidden_layer,
        thinker_eos_ids(config, tokenizer),
    )


def build_hf_engine(stage_config, model_name: str) -> StageEngine:
    model_stage = stage_config.engine_args.model_stage
    if model_stage not in ("thinker", "talker", "code2wav"):
        raise ValueError(
            f"stage {stage_config.stage_id}: engine 'hf' runs model_stage thinker, "
            f"talker or code2wav, not {model_stage!r}"
        )
    return build_engine(stage_config, model_name, make_runner)


def make_runner(stage: HfStage) -> ArRunner | ChunkRunner:
    """Only this stage's part of the model (the talker also gets the thinker's token embedding,
    for the tts special tokens); from a checkpoint nothing else is read."""
    args = stage.config.engine_args
    model, reports = load_stage(
        stage.model,
        args.model_stage,
        load_format="dummy" if args.load_format == "dummy" else "auto",
        seed=args.seed if args.seed is not None else 0,
        dtype=stage.dtype,
    )
    log_reports(stage.config.stage_id, reports)
    return _runner(stage, StageParts.of(stage.place(model)))


# code2wav's C kernels are written for narrow decoders: at the tiny model's 64 channels they run
# ~2-3x faster than torch's ops, at the real model's 1536 torch's are 3.6x faster (2.8 s against
# 0.78 s per 25-frame chunk: `omni-pd bench roofline`, docs/real_shapes.md). `auto` picks by the
# decoder's width: the C kernels up to this many channels (widths in between are unmeasured).
NATIVE_CODE2WAV_MAX_DIM = 256


def code2wav_kernels(requested: str, config, stage_id: int) -> str:
    """The kernels a code2wav stage runs: `auto` resolved by the decoder's width (logged)."""
    if requested != "auto":
        return requested
    chosen = "native" if config.decoder_dim <= NATIVE_CODE2WAV_MAX_DIM else "torch"
    log.info(
        "stage %d: code2wav_kernels auto -> %s (decoder width %d; the C kernels up to %d)",
        stage_id,
        chosen,
        config.decoder_dim,
        NATIVE_CODE2WAV_MAX_DIM,
    )
    return chosen


def _runner(stage: HfStage, parts: StageParts) -> Any:
    args = stage.config.engine_args
    if args.model_stage == "thinker":
        runner = thinker_model(parts, load_tokenizer(resolve_model(stage.model)))
        return ThinkerRunner(runner, stage.attention_kernels)
    if args.model_stage == "talker":
        talker = parts.require("talker")
        speech = TalkerModel(talker, parts.require("thinker_embedding"), parts.config)
        return TalkerRunner(talker, speech, kernels=stage.attention_kernels)
    # The C kernels read host memory and compute float32: torch's stand in elsewhere (logged).
    requested = kernels_for(
        stage.device, args.code2wav_kernels, "code2wav", stage.config.stage_id, stage.dtype
    )
    config = parts.config.code2wav_config
    return Code2WavRunner(
        parts.require("code2wav"),
        config.num_quantizers,
        code2wav_kernels(requested, config, stage.config.stage_id),
    )
