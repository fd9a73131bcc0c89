"""Prompts of a set length in tokens for `omni-pd bench serve --prompt-tokens`: each request's
user message is its drawn length (workload.py) in tokens of the served model's tokenizer, and
begins with its own number, so no two share a prefix (a prefix cache finds nothing to reuse and
every handoff moves the whole prompt)."""

from __future__ import annotations

from typing import Any

from .load import PROMPTS

# Plain text to fill a prompt with, after its number and its question.
_FILLER = (
    "The tide comes in over the flat sand and goes out again, twice a day, pulled by the moon. "
    "Gulls wait on the posts of the old pier for the boats, and the harbour smells of rope, "
    "salt and diesel. In the evening the lamps along the front come on one after another. "
)


def load_tokenizer(model: str) -> Any:
    """The tokenizer of `model` (a checkpoint directory or an embedded model's name)."""
    from transformers import PreTrainedTokenizerFast

    from .. import registry

    return PreTrainedTokenizerFast.from_pretrained(registry.checkpoint_dir(model))


def sized_prompt(tokenizer: Any, num_tokens: int, index: int) -> str:
    """User message number `index`, `num_tokens` tokens long as `tokenizer` encodes it (without
    the chat template's tokens)."""
    if num_tokens < 8:
        raise ValueError(f"--prompt-tokens must be at least 8, got {num_tokens}")
    text = f"Request {index}. {PROMPTS[index % len(PROMPTS)]} "
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += _FILLER
    prompt = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:num_tokens])
    got = len(tokenizer.encode(prompt, add_special_tokens=False))
    if got != num_tokens:  # cut between tokens that merge again once decoded
        raise ValueError(f"prompt {index} re-encodes to {got} tokens, not the {num_tokens} asked")
    return prompt


def sized_prompts(tokenizer: Any, num_tokens: int, count: int, first: int = 0) -> list[str]:
    """`count` user messages of `num_tokens` tokens each, numbered from `first`."""
    return [sized_prompt(tokenizer, num_tokens, index) for index in range(first, first + count)]
