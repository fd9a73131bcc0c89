"""A vLLM P/D pair's tensor_parallel_size against the KV heads of the model the pipeline runs.

At load, the pair check reads the head count from the model a stage names (`engine_args.model`).
The shipped omni stage files name none: the model is `Omni(model=...)` / `omni-pd serve MODEL`,
known only when the orchestrator starts. This runs the same check then, with that model, before
any worker starts, so a size that does not split the heads is refused by stage and key instead of
by a vLLM assertion after a rank process started.
"""

from __future__ import annotations

from omni_pd.config.check_context import CheckContext
from omni_pd.config.errors import ConfigError
from omni_pd.config.pair_checks import check_pd
from omni_pd.config.schema import PipelineConfig


def check_pair_tp_for_model(config: PipelineConfig, model: str, file: str) -> None:
    """Raise ConfigError naming each stage whose tensor_parallel_size does not split `model`'s
    KV heads (whole heads, or whole copies of them, per rank); nothing when it does, when the
    pipeline has no vLLM pair at TP > 1, or when the model's config cannot be read here."""
    pair = [s for s in config.stages if s.is_prefill_only or s.is_decode_only]
    if not any(s.engine == "vllm" and s.engine_args.tensor_parallel_size > 1 for s in pair):
        return
    ctx = CheckContext(
        file=file,
        stages=list(enumerate(config.stages)),
        known_ids=frozenset(config.stage_ids),
        runtime=config.runtime,
        complete=True,
        model=model,
    )
    issues = [i for i in check_pd(ctx) if i.key.endswith(".engine_args.tensor_parallel_size")]
    if issues:
        raise ConfigError(issues)
