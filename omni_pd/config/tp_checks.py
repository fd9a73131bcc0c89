"""A vLLM P/D pair's tensor-parallel sizes: one divides the other, and each side's ranks hold
whole KV heads."""

from __future__ import annotations

from omni_pd import registry
from omni_pd.config.check_context import CheckContext, stage_key
from omni_pd.config.errors import ConfigIssue
from omni_pd.config.schema import StageConfig


def _kv_heads(stage: StageConfig, default_model: str | None) -> int | None:
    """The KV head count of a stage's model (its own `model`, else the pipeline's when known),
    when the model is a checkpoint directory or an embedded model; None when only vLLM can tell."""
    model = stage.engine_args.model or default_model
    return registry.text_kv_heads(model) if model else None


def check_pair_tp(
    ctx: CheckContext, p: tuple[int, StageConfig], d: tuple[int, StageConfig]
) -> list[ConfigIssue]:
    """A vLLM pair may differ in tensor_parallel_size (vLLM's MooncakeConnector maps the ranks
    and reshards the KV heads) when one size divides the other and each side's ranks hold whole
    KV heads (or whole copies of them)."""
    (pi, ps), (di, ds) = p, d
    ptp, dtp = ps.engine_args.tensor_parallel_size, ds.engine_args.tensor_parallel_size
    issues: list[ConfigIssue] = []
    if max(ptp, dtp) % min(ptp, dtp):
        issues.append(
            ctx.issue(
                ds,
                stage_key(di, "engine_args.tensor_parallel_size"),
                dtp,
                f"a divisor or a multiple of prefill stage {ps.stage_id}'s {ptp}",
                f"neither the prefill ({ptp}) nor the decode ({dtp}) tensor_parallel_size divides "
                "the other; the KV connector maps ranks only when one does",
            )
        )
    heads = _kv_heads(ds, ctx.model) or _kv_heads(ps, ctx.model)
    if heads is None or ptp == dtp == 1:
        return issues
    for index, stage, tp in ((pi, ps, ptp), (di, ds, dtp)):
        if heads % tp and tp % heads:
            divisors = [n for n in range(1, heads + 1) if heads % n == 0]
            issues.append(
                ctx.issue(
                    stage,
                    stage_key(index, "engine_args.tensor_parallel_size"),
                    tp,
                    f"a divisor of {heads} ({', '.join(map(str, divisors))}) or a multiple of it",
                    f"the model's {heads} KV heads do not split over {tp} ranks: each rank must hold "
                    "whole KV heads (or whole copies of them) for the KV cache to move between the "
                    "prefill and decode stages",
                )
            )
    return issues
