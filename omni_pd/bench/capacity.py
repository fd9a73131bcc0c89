"""A workload one replica cannot hold at all is refused before any server starts: the longest
request the lengths allow must fit the KV pool of every thinker stage that computes it."""

from __future__ import annotations

from pathlib import Path

from .workload import Workload


def check_kv_capacity(targets: list[tuple[str, Path | None]], workload: Workload) -> None:
    """SystemExit naming the config, the stage and the key when the longest drawn prompt plus
    the longest output (the prompt alone, on a prefill leg) exceeds a thinker stage's
    `kv_pool_blocks * kv_block_size` (the chat template's tokens come on top: this is the least
    such a request needs)."""
    if workload.prompt is None:  # short built-in prompts
        return
    from ..config import load_pipeline_config

    for label, path in targets:
        if path is None:  # --base-url: its pool is not ours to read
            continue
        for stage in load_pipeline_config(path, check_imports=False).stages:
            args = stage.engine_args
            if args.engine != "hf" or args.model_stage != "thinker":
                continue
            need = workload.prompt.hi + (0 if stage.is_prefill_only else workload.output.hi)
            capacity = args.kv_pool_blocks * args.kv_block_size
            if need > capacity:
                raise SystemExit(
                    f"error: {label}: stage {stage.stage_id}'s KV pool holds {capacity} tokens "
                    f"(engine_args.kv_pool_blocks {args.kv_pool_blocks} x kv_block_size "
                    f"{args.kv_block_size}), and a request of this workload needs at least {need} "
                    f"(--prompt-tokens up to {workload.prompt.hi}"
                    + ("" if stage.is_prefill_only else f", --output-tokens up to {workload.output.hi}")
                    + "); raise kv_pool_blocks in that config or shorten the lengths"
                )
