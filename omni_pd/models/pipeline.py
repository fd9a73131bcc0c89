"""What the orchestrator knows of a model: a description it reads, not modules it imports.

A model package (qwen3_omni/ today) says how to load the model's config and tokenizer, how a
user's input becomes the first stage's prompt, which tokens end the text, how long the text
stage's context is and which voices it speaks. The orchestrator routes requests along the
stage YAML's edges with that and nothing else; the stage input processors named in the YAML
carry the rest of the model knowledge.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .qwen3_omni.tiny_config import TINY_MODEL_NAME

DEFAULT_MODEL = TINY_MODEL_NAME


@dataclass(frozen=True)
class ModelPipeline:
    name: str
    config: Any  # the model's top-level config (stage input processors read it)
    tokenizer: Any
    eos_token_ids: frozenset[int]  # tokens that end the text stage's output
    context_len: int  # positions the text stage's model supports
    voices: tuple[str, ...]
    # A user's input (text, chat messages, token ids, ...) -> the model's prompt object, which
    # has a `speaker`; raises ValueError naming what is wrong.
    normalize_prompt: Callable[[Any], Any]
    # That prompt object -> the first stage's prompt (token ids and any audio features).
    build_prompt: Callable[[Any], Any]


def load_model_pipeline(model: str) -> ModelPipeline:
    """The description of `model` (a checkpoint directory or an embedded model's name)."""
    from .qwen3_omni.pipeline import qwen3_omni_pipeline
    return qwen3_omni_pipeline(model)
