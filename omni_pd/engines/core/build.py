"""An engine for a stage from its model's runner: the stage's role picks the class."""

from __future__ import annotations

from .ar_engine import ArEngine
from .pd_legs import DecodeEngine, PrefillEngine
from .runner import ArRunner


def ar_engine(stage_config, runner: ArRunner) -> ArEngine:
    """The colocated engine, or the prefill or decode leg of a P/D pair (`is_prefill_only` /
    `is_decode_only`)."""
    if stage_config.is_prefill_only:
        return PrefillEngine(stage_config, runner)
    if stage_config.is_decode_only:
        return DecodeEngine(stage_config, runner)
    return ArEngine(stage_config, runner)
