"""A byte-level tokenizer for the tiny model, built in code with the `tokenizers` library.

256 byte tokens (any UTF-8 text encodes), the role words `system`/`user`/`assistant` as single
tokens (transformers' talker hand-off finds the user turns by the token after `<|im_start|>`),
then the Qwen3-Omni special tokens, all pinned to the ids in `tiny_config.py`.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from ..byte_tokenizer import build_byte_level_tokenizer, chat_template
from .tiny_config import ROLE_TOKENS, SPECIAL_TOKENS

# Each audio part becomes one <|audio_pad|>, which the prompt builder expands.
CHAT_TEMPLATE = chat_template("<|audio_start|><|audio_pad|><|audio_end|>")


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_byte_level_tokenizer(
        ROLE_TOKENS, SPECIAL_TOKENS, CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
