"""The tiny Qwen2.5-Omni's tokenizer: byte-level (models/byte_tokenizer.py), the role words as
single tokens, then Qwen2.5-Omni's special tokens, all pinned to the ids in `tiny_config.py`."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from ..byte_tokenizer import build_byte_level_tokenizer, chat_template
from .tiny_config import ROLE_TOKENS, SPECIAL_TOKENS

# Each audio part becomes one <|AUDIO|>, which the prompt builder expands (as transformers' processor).
CHAT_TEMPLATE = chat_template("<|audio_bos|><|AUDIO|><|audio_eos|>")


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_byte_level_tokenizer(
        ROLE_TOKENS, SPECIAL_TOKENS, CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
