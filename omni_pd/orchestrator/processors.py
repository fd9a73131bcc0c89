"""Stage input processors named in a stage YAML (`custom_process_input_func`), and their
streaming counterparts (`<name>_stream`, used with `async_chunk`)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from ..config import PipelineConfig


def import_processor(dotted: str) -> Callable[..., Any]:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def import_stream_processor(dotted: str) -> Callable[..., Any] | None:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), f"{name}_stream", None)


def stream_processors(config: PipelineConfig) -> dict[int, Callable[..., Any]]:
    """With `async_chunk`, each stage fed by one source stage through a processor that has a
    streaming counterpart starts with its source and takes the source's output in chunks."""
    found: dict[int, Callable[..., Any]] = {}
    if not config.async_chunk:
        return found
    for stage in config.stages:
        if stage.custom_process_input_func and len(stage.engine_input_source) == 1:
            factory = import_stream_processor(stage.custom_process_input_func)
            if factory is not None:
                found[stage.stage_id] = factory
    return found
