"""Build a stage's engine from its config (runs inside the stage's worker process)."""
from __future__ import annotations

from .. import registry
from ..engines.base import StageEngine


def build_engine(stage, model: str) -> StageEngine:
    if stage.engine == "hf":
        # hf engines are written per model: the model's package builds them.
        return registry.engine_builder(model, "hf")(stage, model)
    if stage.engine == "vllm":
        from ..engines.vllm.engine import build_vllm_engine
        # vLLM's engine is generic; a model that needs more than tokens out of it (an omni
        # thinker's rows for its talker) adds hooks from its package.
        served = stage.engine_args.model or model
        return build_vllm_engine(stage, model, registry.vllm_hooks(served))
    raise NotImplementedError(f"stage {stage.stage_id}: engine {stage.engine!r} is not available in "
                              "this build; use engine: hf")
