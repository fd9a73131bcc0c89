"""hf (transformers) engines for Qwen2.5-Omni's stages: this package's runners, made by
`make_runner` for the one hf engine builder (engines/hf/builder.py)."""

from __future__ import annotations

import logging

from omni_pd.engines.base import StageEngine
from omni_pd.engines.core.runner import ArRunner
from omni_pd.engines.hf.builder import HfStage, build_hf_engine as build_engine

from ..factory import load_model, load_tokenizer, resolve_model
from ..pipeline import thinker_eos_ids
from .thinker_runner import ThinkerRunner

log = logging.getLogger(__name__)

STAGES = ("thinker",)  # the talker and token2wav are not served yet


def build_hf_engine(stage_config, model_name: str) -> StageEngine:
    model_stage = stage_config.engine_args.model_stage
    if model_stage not in STAGES:
        raise ValueError(
            f"stage {stage_config.stage_id}: omni-pd's hf engine runs Qwen2.5-Omni's "
            f"{', '.join(STAGES)} so far, not model_stage {model_stage!r}"
        )
    return build_engine(stage_config, model_name, make_runner)


def make_runner(stage: HfStage) -> ArRunner:
    args = stage.config.engine_args
    model = load_model(
        stage.model,
        load_format="dummy" if args.load_format == "dummy" else "auto",
        seed=args.seed if args.seed is not None else 0,
        dtype=stage.dtype,
    )
    tokenizer = load_tokenizer(resolve_model(stage.model))
    thinker = stage.place(model.thinker)
    return ThinkerRunner(thinker, tokenizer, thinker_eos_ids(tokenizer), stage.attention_kernels)
