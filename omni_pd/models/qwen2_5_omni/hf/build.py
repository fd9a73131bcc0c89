"""hf (transformers) engines for Qwen2.5-Omni's three stages: this package's runners, made by
`make_runner` for the one hf engine builder (engines/hf/builder.py). vllm-omni names the stages
thinker, talker and code2wav (token2wav, here)."""

from __future__ import annotations

import logging

from omni_pd.engines.base import StageEngine
from omni_pd.engines.core.runner import ArRunner, ChunkRunner
from omni_pd.engines.hf.builder import HfStage, build_hf_engine as build_engine

from ..factory import load_model, load_speakers, load_tokenizer, resolve_model
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
    """The stage's runner on the stage's device (token2wav in float32, as transformers runs it).
    Every stage builds the whole tiny model; a real checkpoint's lean per-stage loading is not
    written yet."""
    args = stage.config.engine_args
    seed = args.seed if args.seed is not None else 0
    model = load_model(
        stage.model,
        load_format="dummy" if args.load_format == "dummy" else "auto",
        seed=seed,
        dtype=stage.dtype,
    )
    source = resolve_model(stage.model)
    if args.model_stage == "thinker":
        tokenizer = load_tokenizer(source)
        thinker = stage.place(model.thinker)
        return ThinkerRunner(thinker, tokenizer, thinker_eos_ids(tokenizer), stage.attention_kernels)
    speakers = load_speakers(source, seed)
    if args.model_stage == "talker":
        talker = stage.place(model.talker)
        embedding = stage.place(model.thinker.get_input_embeddings())
        return TalkerRunner(talker, embedding, Voices(speakers), stage.attention_kernels)
    token2wav = Token2Wav(model.token2wav.float(), seed=seed, num_steps=args.token2wav_num_steps)
    return Token2WavRunner(token2wav, speakers, DEFAULT_VOICE)
