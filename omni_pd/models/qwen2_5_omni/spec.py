"""Qwen2.5-Omni as the registry sees it (omni_pd/registry.py): named in pyproject.toml's
`omni_pd.models` entry points. Each callable imports the model code it needs when called."""

from __future__ import annotations

from typing import Any

from omni_pd.registry import AUTOREGRESSIVE, CHUNKED, EngineArg, ModelPipeline, ModelSpec

from .tiny_config import TINY_MODEL_NAME
from .vllm import ARCHITECTURE, MODEL_CLASS


def _pipeline(model: str) -> ModelPipeline:
    from .pipeline import qwen2_5_omni_pipeline

    return qwen2_5_omni_pipeline(model)


def _build_hf_engine(stage_config: Any, model: str) -> Any:
    from .hf.build import build_hf_engine

    return build_hf_engine(stage_config, model)


def _materialize(model: str, seed: int) -> str:
    from .factory import ensure_tiny_checkpoint

    return str(ensure_tiny_checkpoint(seed))


def _write_tiny_checkpoint(directory: str, seed: int) -> Any:
    from .factory import save_tiny_model

    return save_tiny_model(directory, seed)


def _roofline_thinker(checkpoint: str, dtype: Any, device: Any, kernels: str) -> Any:
    from .factory import load_stage, resolve_model
    from .hf.build import thinker_runner
    from .hf.thinker_runner import ThinkerState

    parts, _ = load_stage(checkpoint, "thinker", dtype=dtype)
    thinker = parts.require("thinker").to(device)
    return thinker_runner(thinker, resolve_model(checkpoint), kernels), ThinkerState


def _write_real_checkpoint(directory: str, layers: int, seed: int, max_shard_size: int) -> Any:
    from .real_checkpoint import save_real_model

    return save_real_model(directory, layers, seed=seed, max_shard_size=max_shard_size)


def _vllm_hooks(model: str) -> Any:
    from .factory import load_config, resolve_model
    from .vllm.hooks import Qwen2_5OmniThinkerHooks

    return Qwen2_5OmniThinkerHooks(load_config(resolve_model(model)).thinker_config.audio_token_index)


def _config_dict(model: str) -> dict[str, Any]:
    from .tiny_config import tiny_config_dict

    return tiny_config_dict()


_VLLM_OMNI = "vllm_omni.model_executor.stage_input_processors.qwen2_5_omni"
_OURS = "omni_pd.models.qwen2_5_omni.stage_input_processors"

SPEC = ModelSpec(
    name="qwen2_5_omni",
    model_types=("qwen2_5_omni",),
    embedded=(TINY_MODEL_NAME,),
    load_pipeline=_pipeline,
    engine_builders={"hf": _build_hf_engine},
    # vllm-omni names the stages thinker, talker and code2wav (token2wav is its code2wav).
    hf_stages={"thinker": AUTOREGRESSIVE, "talker": AUTOREGRESSIVE, "code2wav": CHUNKED},
    engine_args={
        # token2wav's ODE steps (transformers' `num_steps`, default 10): fewer is faster and coarser.
        "token2wav_num_steps": EngineArg(int, 10, "a Qwen2.5-Omni code2wav stage runs on engine: hf"),
    },
    # vllm-omni's names for this model's stage input processors (config/aliases.py), every
    # flavour mapped to the one processor (omni-pd picks streaming itself).
    processor_aliases={
        f"{_VLLM_OMNI}.{name}": f"{_OURS}.{target}"
        for name, target in (
            ("thinker2talker", "thinker2talker"),
            ("thinker2talker_token_only", "thinker2talker"),
            ("thinker2talker_full_payload", "thinker2talker"),
            ("talker2code2wav", "talker2code2wav"),
            ("talker2code2wav_token_only", "talker2code2wav"),
            ("talker2code2wav_full_payload", "talker2code2wav"),
            ("talker2codewav", "talker2code2wav"),  # sic: its async-chunk stage file's spelling
        )
    },
    materialize=_materialize,
    write_tiny_checkpoint=_write_tiny_checkpoint,
    write_real_checkpoint=_write_real_checkpoint,
    roofline_thinker=_roofline_thinker,
    config_dict=_config_dict,
    text_config_keys=("thinker_config", "text_config"),
    vllm_hooks=_vllm_hooks,
    vllm_model_classes={ARCHITECTURE: MODEL_CLASS},
    worker_preload=("omni_pd.models.qwen2_5_omni.hf.build",),
)
