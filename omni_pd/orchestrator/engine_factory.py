"""Build a stage's engine from its config (runs inside the stage's worker process)."""

from __future__ import annotations

from .. import registry
from ..engines.base import StageEngine


def build_engine(stage, model: str) -> StageEngine:
    """`model`: the pipeline's model; a stage whose engine_args name a model of their own (a
    text LLM serving one stage of the pipeline) runs that one."""
    served = stage.engine_args.model or model
    if stage.engine == "hf":
        # hf engines are the generic ones on the model's runners: the model's package builds them.
        return registry.engine_builder(served, "hf")(stage, served)
    if stage.engine == "vllm":
        from ..engines.vllm.engine import build_vllm_engine

        # vLLM's engine is generic; a model that needs more than tokens out of it (an omni
        # model's rows for its next stage) adds hooks from its package.
        return build_vllm_engine(stage, model, registry.vllm_hooks(served))
    raise NotImplementedError(
        f"stage {stage.stage_id}: engine {stage.engine!r} is not available in this build; use engine: hf"
    )
