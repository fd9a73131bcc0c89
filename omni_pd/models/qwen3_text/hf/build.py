"""The hf engine of a Qwen3 text stage: its runner factory for the one hf engine builder
(engines/hf/builder.py)."""

from __future__ import annotations

from pathlib import Path

from omni_pd.engines.base import StageEngine
from omni_pd.engines.hf.builder import HfStage, build_hf_engine as build_engine

from .text_runner import DTYPES, Qwen3TextRunner


def build_hf_engine(stage_config, model: str) -> StageEngine:
    """An hf engine for a stage of the text model."""
    return build_engine(stage_config, model, make_runner, dtypes=DTYPES)


def make_runner(stage: HfStage) -> Qwen3TextRunner:
    """The stage's checkpoint (the embedded tiny model is written out with the stage's seed) on
    the stage's device."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from ..tiny_config import DEFAULT_SEED, TINY_TEXT_MODEL_NAME, ensure_tiny_text_model

    args = stage.config.engine_args
    directory = (
        ensure_tiny_text_model(args.seed if args.seed is not None else DEFAULT_SEED)
        if stage.model == TINY_TEXT_MODEL_NAME
        else Path(stage.model)
    )
    llm = Qwen3ForCausalLM.from_pretrained(directory, dtype=stage.dtype).eval()
    for parameter in llm.parameters():  # safetensors can leave weights at odd addresses
        parameter.data = parameter.data.clone()
    llm = stage.place(llm)
    return Qwen3TextRunner(
        llm, AutoTokenizer.from_pretrained(directory), args.model_stage, stage.attention_kernels
    )
