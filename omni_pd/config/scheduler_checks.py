"""Rules on an hf stage's step budget: `max_num_batched_tokens` against its KV block and its
seats (vLLM refuses the same)."""

from __future__ import annotations

from omni_pd.config.check_context import CheckContext, stage_key
from omni_pd.config.errors import ConfigIssue


def check_step_budget(ctx: CheckContext) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for index, stage in ctx.stages:
        args = stage.engine_args
        if args.engine != "hf" or args.max_num_batched_tokens is None:
            continue
        budget = args.max_num_batched_tokens
        key = stage_key(index, "engine_args.max_num_batched_tokens")
        if args.enable_chunked_prefill is not False and budget < args.kv_block_size:
            issues.append(
                ctx.issue(
                    stage,
                    key,
                    budget,
                    f"at least kv_block_size ({args.kv_block_size})",
                    "with chunked prefill a step's prompt chunk must be able to fill a KV block",
                )
            )
        if budget < stage.max_num_seqs:
            issues.append(
                ctx.issue(
                    stage,
                    key,
                    budget,
                    f"at least max_num_seqs ({stage.max_num_seqs}), or lower max_num_seqs",
                    "every running request decodes one token a step within this budget",
                )
            )
    return issues
