"""hf (transformers) engines for Qwen2.5-Omni's three stages: this package's runners, made by
`make_runner` for the one hf engine builder (engines/hf/builder.py). vllm-omni names the stages
thinker, talker and code2wav (token2wav, here)."""

from __future__ import annotations

import logging

import torch

from omni_pd.engines.base import StageEngine
from omni_pd.engines.core.runner import ArRunner, ChunkRunner
from omni_pd.engines.hf.builder import HfStage, build_hf_engine as build_engine

from ...lean_load import log_reports
from ..factory import ModelSource, load_speakers, load_stage, load_tokenizer, resolve_model
from ..pipeline import thinker_eos_ids
from ..tiny_config import DEFAULT_VOICE
from .talker_runner import TalkerRunner, Voices
from .thinker_runner import ThinkerRunner
from .token2wav import Token2Wav
from .token2wav_runner import Token2WavRunner

log = logging.getLogger(__name__)

STAGES = ("thinker", "talker", "code2wav")


def build_hf_engine(stage_config, model_name: str) -> StageEngine:
    model_stage = stage_config.engine_args.model_stage
    if model_stage not in STAGES:
        raise ValueError(
            f"stage {stage_config.stage_id}: omni-pd's hf engine runs Qwen2.5-Omni's "
            f"{', '.join(STAGES)} (code2wav: its token2wav), not model_stage {model_stage!r}"
        )
    return build_engine(stage_config, model_name, make_runner)


def make_runner(stage: HfStage) -> ArRunner | ChunkRunner:
    """The stage's runner on the stage's device, from its part of the model only (the talker also
    gets the thinker's token embedding; token2wav is float32, as transformers runs it): from a
    checkpoint nothing else is read."""
    args = stage.config.engine_args
    seed = args.seed if args.seed is not None else 0
    parts, reports = load_stage(
        stage.model,
        args.model_stage,
        load_format="dummy" if args.load_format == "dummy" else "auto",
        seed=seed,
        dtype=stage.dtype,
    )
    log_reports(stage.config.stage_id, reports)
    source = resolve_model(stage.model)
    if args.model_stage == "thinker":
        return thinker_runner(stage.place(parts.require("thinker")), source, stage.attention_kernels)
    speakers = load_speakers(source, seed)
    if args.model_stage == "talker":
        talker = stage.place(parts.require("talker"))
        embedding = stage.place(parts.require("thinker_embedding"))
        return TalkerRunner(talker, embedding, Voices(speakers), stage.attention_kernels)
    token2wav = Token2Wav(parts.require("token2wav").float(), seed=seed, num_steps=args.token2wav_num_steps)
    return Token2WavRunner(token2wav, speakers, DEFAULT_VOICE)


def thinker_runner(thinker: torch.nn.Module, source: ModelSource, kernels: str) -> ThinkerRunner:
    """The thinker's runner, with the checkpoint's tokenizer and its EOS ids (also what
    `bench roofline` times)."""
    tokenizer = load_tokenizer(source)
    return ThinkerRunner(thinker, tokenizer, thinker_eos_ids(tokenizer), kernels)
