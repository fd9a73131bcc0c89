"""The tiny text-only Qwen3 as the registry sees it: a checkpoint for vLLM stages, not a
pipeline's model (the orchestrator's prompts come from the pipeline's model)."""
from __future__ import annotations

from omni_pd.registry import ModelSpec

from .tiny import TINY_TEXT_MODEL_NAME


def _materialize(model: str, seed: int) -> str:
    from .tiny import ensure_tiny_text_model
    return str(ensure_tiny_text_model(seed))


SPEC = ModelSpec(name="qwen3_text", embedded=(TINY_TEXT_MODEL_NAME,), materialize=_materialize)
