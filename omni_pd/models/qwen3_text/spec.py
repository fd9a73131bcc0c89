"""The tiny text-only Qwen3 as the registry sees it: a stage's checkpoint, not a pipeline's model
(the orchestrator's prompts come from the pipeline's model). Its stages run on vLLM, or on
omni-pd's hf engines through its runner (hf.py)."""

from __future__ import annotations

from typing import Any

from omni_pd.registry import AUTOREGRESSIVE, ModelSpec

from .tiny_config import TINY_TEXT_MODEL_NAME


def _materialize(model: str, seed: int) -> str:
    from .tiny_config import ensure_tiny_text_model

    return str(ensure_tiny_text_model(seed))


def _config_dict(model: str) -> dict[str, Any]:
    from .tiny_config import tiny_text_config_dict

    return tiny_text_config_dict()


def _build_hf_engine(stage_config: Any, model: str) -> Any:
    from .hf.build import build_hf_engine

    return build_hf_engine(stage_config, model)


SPEC = ModelSpec(
    name="qwen3_text",
    model_types=("qwen3",),
    embedded=(TINY_TEXT_MODEL_NAME,),
    materialize=_materialize,
    config_dict=_config_dict,
    engine_builders={"hf": _build_hf_engine},
    # The text stage keeps the pipeline's name for it (a Qwen3-Omni pipeline's).
    hf_stages={"thinker": AUTOREGRESSIVE},
)
