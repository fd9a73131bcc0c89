"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts
(front end, engine core, workers), so omni-pd's connector fixes are in place wherever the
MooncakeConnector runs. Idempotent; never raises (a fix that does not fit the installed vLLM is
refused and logged once; see patches/_guard.py)."""
from __future__ import annotations


def register() -> None:
    from .patches import apply_all
    apply_all()
