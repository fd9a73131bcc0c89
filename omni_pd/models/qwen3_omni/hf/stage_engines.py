"""hf (transformers) engines for the three Qwen3-Omni stages: the generic engines of
`engines/core` on this package's runners, built from a stage config."""

from __future__ import annotations

import logging
import time

import torch

from ..factory import load_stage, load_tokenizer, resolve_model
from ..pipeline import thinker_eos_ids
from omni_pd.config.devices import stage_device
from omni_pd.engines.base import StageEngine
from omni_pd.engines.device import check_dtype, enter as enter_device, kernels_for
from omni_pd.engines.core.build import ar_engine
from omni_pd.engines.core.chunked import ChunkedEngine
from ..stage_parts import StageParts
from .code2wav import Code2WavStageRunner
from .talker import TalkerRunner
from .talker_batch import BatchedTalker
from .thinker import ThinkerRunner
from .thinker_stage import ThinkerStageRunner

log = logging.getLogger(__name__)

_DTYPES = {
    "auto": torch.float32,
    "float": torch.float32,
    "float32": torch.float32,
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def thinker_runner(model, tokenizer) -> ThinkerRunner:
    """`model`: a whole model or a thinker stage's StageParts."""
    parts = StageParts.of(model)
    config = parts.config
    return ThinkerRunner(
        parts.require("thinker"),
        tokenizer,
        config.talker_config.accept_hidden_layer,
        thinker_eos_ids(config, tokenizer),
    )


def build_hf_engine(stage_config, model_name: str) -> StageEngine:
    args = stage_config.engine_args
    model_stage = args.model_stage
    if model_stage not in ("thinker", "talker", "code2wav"):
        raise ValueError(
            f"stage {stage_config.stage_id}: engine 'hf' runs model_stage thinker, "
            f"talker or code2wav, not {model_stage!r}"
        )
    name = model_name  # the stage's engine_args.model, else the pipeline's (engine_factory)
    dtype = _DTYPES[args.dtype]
    device = stage_device(stage_config)  # raises, naming the stage, where its GPU is not visible
    check_dtype(device, dtype, stage_config.stage_id)
    began = time.perf_counter()
    # Only this stage's part (the talker also gets the thinker's token embedding, for the tts
    # special tokens); from a checkpoint nothing else is read.
    model, reports = load_stage(
        name,
        model_stage,
        load_format="dummy" if args.load_format == "dummy" else "auto",
        seed=args.seed if args.seed is not None else 0,
        dtype=dtype,
    )
    for r in reports:
        log.info(
            "stage %d: loaded %s part, %d tensors, %.1f MiB from %d of %d shards in %.2f s",
            stage_config.stage_id,
            r.part,
            r.tensors,
            r.bytes / 2**20,
            len(r.shards_read),
            r.shards_total,
            r.seconds,
        )
    if device != "cpu":
        enter_device(device)
        model = model.to(device)
    # The C kernels read host memory and compute float32: torch's kernels stand in on the GPU
    # and in other dtypes (logged once).
    args = args.model_copy(
        update={
            "attention_kernels": kernels_for(
                device, args.attention_kernels, "attention", stage_config.stage_id, dtype
            ),
            "code2wav_kernels": kernels_for(
                device, args.code2wav_kernels, "code2wav", stage_config.stage_id, dtype
            ),
        }
    )
    stage_config = stage_config.model_copy(update={"engine_args": args})
    log.info(
        "stage %d: hf %s engine ready in %.1f s on %s (model %s, load_format %s)",
        stage_config.stage_id,
        model_stage,
        time.perf_counter() - began,
        device,
        name,
        args.load_format,
    )
    engine = _build(stage_config, model, model_stage, name)
    engine.device = device
    return engine


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


def _build(stage_config, model: StageParts, model_stage: str, name: str) -> StageEngine:
    """The generic engines (engines/core) on this model's runners."""
    args = stage_config.engine_args
    parts = StageParts.of(model)
    if model_stage == "thinker":
        runner = ThinkerStageRunner(
            thinker_runner(parts, load_tokenizer(resolve_model(name))), args.attention_kernels
        )
        return ar_engine(stage_config, runner)
    if model_stage == "talker":
        talker = parts.require("talker")
        speech = TalkerRunner(talker, parts.require("thinker_embedding"), parts.config)
        return ar_engine(stage_config, BatchedTalker(talker, speech, kernels=args.attention_kernels))
    runner = Code2WavStageRunner(
        parts.require("code2wav"),
        parts.config.code2wav_config.num_quantizers,
        code2wav_kernels(args.code2wav_kernels, parts.config.code2wav_config, stage_config.stage_id),
    )
    return ChunkedEngine(
        stage_config.stage_id,
        runner,
        initial_chunk_frames=args.initial_codec_chunk_frames,
        chunk_frames=args.codec_chunk_frames,
        left_context_frames=args.codec_left_context_frames,
    )
