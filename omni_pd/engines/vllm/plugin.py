"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts
(front end, engine core, workers), so omni-pd's connector fixes are in place wherever the
MooncakeConnector runs, and the model classes of omni-pd's registered models (an omni thinker
that can record rows for its talker) are known wherever vLLM builds a model. Idempotent; never
raises (a fix that does not fit the installed vLLM is refused and logged once; see
patches/_guard.py)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    from .patches import apply_all

    apply_all()
    register_model_classes()


def register_model_classes() -> None:
    from vllm import ModelRegistry

    from ... import registry

    try:
        classes = registry.vllm_model_classes()
    except registry.ModelNotFound as exc:  # omni-pd not installed: vLLM keeps its own classes
        log.warning("omni-pd's vLLM model classes are not registered: %s", exc)
        return
    for architecture, model_class in classes.items():
        ModelRegistry.register_model(architecture, model_class)
