"""Qwen2.5-Omni as the registry sees it (omni_pd/registry.py): named in pyproject.toml's
`omni_pd.models` entry points. Each callable imports the model code it needs when called."""

from __future__ import annotations

from typing import Any

from omni_pd.registry import AUTOREGRESSIVE, CHUNKED, ModelPipeline, ModelSpec

from .tiny_config import TINY_MODEL_NAME


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


def _config_dict(model: str) -> dict[str, Any]:
    from .tiny_config import tiny_config_dict

    return tiny_config_dict()


SPEC = ModelSpec(
    name="qwen2_5_omni",
    model_types=("qwen2_5_omni",),
    embedded=(TINY_MODEL_NAME,),
    load_pipeline=_pipeline,
    engine_builders={"hf": _build_hf_engine},
    # vllm-omni names the stages thinker, talker and code2wav (token2wav is its code2wav).
    hf_stages={"thinker": AUTOREGRESSIVE, "talker": AUTOREGRESSIVE, "code2wav": CHUNKED},
    materialize=_materialize,
    write_tiny_checkpoint=_write_tiny_checkpoint,
    config_dict=_config_dict,
    text_config_keys=("thinker_config", "text_config"),
    worker_preload=("omni_pd.models.qwen2_5_omni.hf.build",),
)
