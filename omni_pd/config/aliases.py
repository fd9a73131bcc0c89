"""vllm-omni's names for its stage input processors, resolved to omni-pd's own (each model package
declares its aliases in its `ModelSpec.processor_aliases`).

vllm-omni's stage files name processors by dotted path into `vllm_omni`, which omni-pd does not
need installed. Two keys carry them:
- `custom_process_input_func` on the consuming stage (the file's legacy, non-streamed form);
- `engine_args.custom_process_next_stage_input_func` on the producing stage (its `async_chunk`
  form): the processor then belongs to every stage fed by that one.
Both resolve here before validation. omni-pd picks the streamed variant of a processor itself
when `async_chunk` is on, so vllm-omni's `_async_chunk`, `_full_payload` and `_token_only`
flavours all map to the one processor that computes the same input.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from omni_pd import registry

log = logging.getLogger(__name__)

_logged: set[str] = set()


def resolve_processor(dotted: str) -> str:
    """omni-pd's processor for a vllm-omni name (logged at INFO once per name), else `dotted`."""
    ours = registry.processor_aliases().get(dotted)
    if ours is None:
        return dotted
    if dotted not in _logged:
        _logged.add(dotted)
        log.info("stage input processor %s is vllm-omni's; omni-pd runs its own %s", dotted, ours)
    return ours


def apply_processor_aliases(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a raw stage_args document with vllm-omni processor names resolved, and each
    `custom_process_next_stage_input_func` given to the stages its stage feeds (unless they name
    their own `custom_process_input_func`). Malformed entries are left for validation to report."""
    stages = data.get("stage_args")
    if not isinstance(stages, list):
        return dict(data)
    out = [dict(s) if isinstance(s, Mapping) else s for s in stages]
    for stage in out:
        if isinstance(stage, dict) and isinstance(stage.get("custom_process_input_func"), str):
            stage["custom_process_input_func"] = resolve_processor(stage["custom_process_input_func"])
    for producer in out:
        if not isinstance(producer, dict) or not isinstance(producer.get("engine_args"), Mapping):
            continue
        next_func = producer["engine_args"].get("custom_process_next_stage_input_func")
        if not isinstance(next_func, str):
            continue
        for consumer in out:
            sources = consumer.get("engine_input_source") if isinstance(consumer, dict) else None
            if (
                isinstance(sources, list)
                and producer.get("stage_id") in sources
                and not consumer.get("custom_process_input_func")
            ):
                consumer["custom_process_input_func"] = resolve_processor(next_func)
    return {**data, "stage_args": out}
