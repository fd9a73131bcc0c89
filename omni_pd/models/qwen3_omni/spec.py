"""Qwen3-Omni-MoE as the registry sees it (omni_pd/registry.py): named in pyproject.toml's
`omni_pd.models` entry points. Each callable imports the model code it needs when called."""

from __future__ import annotations

from typing import Any, Literal

from omni_pd.registry import AUTOREGRESSIVE, CHUNKED, EngineArg, ModelPipeline, ModelSpec

from .tiny_config import TINY_MODEL_NAME
from .vllm import ARCHITECTURE, MODEL_CLASS


def _pipeline(model: str) -> ModelPipeline:
    from .pipeline import qwen3_omni_pipeline

    return qwen3_omni_pipeline(model)


def _build_hf_engine(stage_config: Any, model: str) -> Any:
    from .hf.build import build_hf_engine

    return build_hf_engine(stage_config, model)


def _materialize(model: str, seed: int) -> str:
    from .factory import ensure_tiny_checkpoint

    return str(ensure_tiny_checkpoint(seed))


def _config_dict(model: str) -> dict[str, Any]:
    from .tiny_config import tiny_config_dict

    return tiny_config_dict()


def _roofline_thinker(checkpoint: str, dtype: Any, device: Any, kernels: str) -> Any:
    from .factory import load_stage, load_tokenizer, resolve_model
    from .hf.build import thinker_model
    from .hf.thinker_runner import ThinkerRunner, ThinkerState

    parts, _ = load_stage(checkpoint, "thinker", dtype=dtype)
    if device.type != "cpu":
        parts = parts.to(device)
    return ThinkerRunner(
        thinker_model(parts, load_tokenizer(resolve_model(checkpoint))), kernels
    ), ThinkerState


def _write_real_checkpoint(directory: str, layers: int, seed: int, max_shard_size: int) -> Any:
    from .real_checkpoint import save_real_model

    return save_real_model(directory, layers, seed=seed, max_shard_size=max_shard_size)


def _vllm_hooks(model: str) -> Any:
    from .factory import load_config, resolve_model
    from .vllm.hooks import Qwen3OmniThinkerHooks

    config = load_config(resolve_model(model))
    return Qwen3OmniThinkerHooks(
        config.talker_config.accept_hidden_layer, config.thinker_config.audio_token_id
    )


def _topologies() -> dict[str, Any]:
    from .topology import PIPELINES

    return dict(PIPELINES)


def _native_kernels() -> tuple[Any, ...]:
    from .hf.code2wav_native import CODE2WAV

    return (CODE2WAV,)


_VLLM_OMNI = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"
_OURS = "omni_pd.models.qwen3_omni.stage_input_processors"

SPEC = ModelSpec(
    name="qwen3_omni",
    model_types=("qwen3_omni_moe",),
    embedded=(TINY_MODEL_NAME,),
    load_pipeline=_pipeline,
    engine_builders={"hf": _build_hf_engine},
    hf_stages={"thinker": AUTOREGRESSIVE, "talker": AUTOREGRESSIVE, "code2wav": CHUNKED},
    engine_args={
        # code2wav's convolutional decoder on omni-pd's C kernels (built with the system C
        # compiler; faster on narrow decoders) or on torch ops (faster at the real model's
        # width); `auto` picks by the decoder's width. All keep streamed chunks exact.
        "code2wav_kernels": EngineArg(
            Literal["auto", "native", "torch"], "auto", "a code2wav stage runs on engine: hf"
        ),
    },
    vllm_omni_engine_args=("subtalker_sampling_params",),
    # vllm-omni's names for this model's stage input processors (config/aliases.py): its legacy
    # stage_args files, and vllm-omni 0.30's (the deploy schema's pipeline in code). omni-pd
    # picks the streamed variant itself, so every flavour maps to the one processor.
    processor_aliases={
        f"{_VLLM_OMNI}.thinker2talker": f"{_OURS}.thinker2talker",
        f"{_VLLM_OMNI}.talker2code2wav": f"{_OURS}.talker2code2wav",
        f"{_VLLM_OMNI}.thinker2talker_async_chunk": f"{_OURS}.thinker2talker",
        f"{_VLLM_OMNI}.talker2code2wav_async_chunk": f"{_OURS}.talker2code2wav",
        f"{_VLLM_OMNI}.thinker2talker_full_payload": f"{_OURS}.thinker2talker",
        f"{_VLLM_OMNI}.thinker2talker_token_only": f"{_OURS}.thinker2talker",
        f"{_VLLM_OMNI}.talker2code2wav_full_payload": f"{_OURS}.talker2code2wav",
    },
    materialize=_materialize,
    write_real_checkpoint=_write_real_checkpoint,
    roofline_thinker=_roofline_thinker,
    config_dict=_config_dict,
    text_config_keys=("thinker_config", "text_config"),
    vllm_hooks=_vllm_hooks,
    vllm_model_classes={ARCHITECTURE: MODEL_CLASS},
    topologies=_topologies,
    default_topologies=("qwen3_omni_moe", "qwen3_omni_moe_pd"),
    native_kernels=_native_kernels,
    worker_preload=("omni_pd.models.qwen3_omni.hf.build",),
    default=True,
)
