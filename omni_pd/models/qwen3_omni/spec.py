"""Qwen3-Omni-MoE as the registry sees it (omni_pd/registry.py): named in pyproject.toml's
`omni_pd.models` entry points. Each callable imports the model code it needs when called."""
from __future__ import annotations

from typing import Any

from omni_pd.registry import ModelPipeline, ModelSpec

from .tiny_config import TINY_MODEL_NAME


def _pipeline(model: str) -> ModelPipeline:
    from .pipeline import qwen3_omni_pipeline
    return qwen3_omni_pipeline(model)


def _build_hf_engine(stage_config: Any, model: str) -> Any:
    from .hf.stage_engines import build_hf_engine
    return build_hf_engine(stage_config, model)


def _topologies() -> dict[str, Any]:
    from .topology import PIPELINES
    return dict(PIPELINES)


def _native_kernels() -> tuple[Any, ...]:
    from .hf.code2wav_native import CODE2WAV
    return (CODE2WAV,)


SPEC = ModelSpec(
    name="qwen3_omni",
    model_types=("qwen3_omni_moe",),
    embedded=(TINY_MODEL_NAME,),
    load_pipeline=_pipeline,
    engine_builders={"hf": _build_hf_engine},
    topologies=_topologies,
    default_topologies=("qwen3_omni_moe", "qwen3_omni_moe_pd"),
    native_kernels=_native_kernels,
    default=True,
)
