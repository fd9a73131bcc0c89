"""Byte-level tokenizers for the embedded tiny models, built in code with the `tokenizers` library.

256 byte tokens (token id == byte value, so any UTF-8 text encodes), then whole words and special
tokens each pinned to the id its model's tiny config gives it.
"""

from __future__ import annotations

from typing import Mapping

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

NUM_BYTE_TOKENS = 256


def chat_template(audio_markup: str) -> str:
    """Qwen's chat template, reduced to what a tiny model needs: string content or a list of
    {"type": "text"|"audio"|"input_audio"} parts, each audio part written as `audio_markup` (its
    one placeholder, which the prompt builder expands to the audio encoder's output length)."""
    return (
        "{%- for message in messages -%}"
        "<|im_start|>{{ message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
        "{%- elif part['type'] in ('audio', 'input_audio') -%}"
        + audio_markup
        + "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "<|im_end|>{{ '\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>{{ 'assistant\\n' }}{%- endif -%}"
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which ByteLevel pre-tokenizing uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
    printable += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    mapping, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shift)
            shift += 1
    return mapping


def build_byte_level_tokenizer(
    words: Mapping[str, int],
    specials: Mapping[str, int],
    chat_template: str,
    eos_token: str,
    pad_token: str,
) -> PreTrainedTokenizerFast:
    """`words` are plain added tokens (e.g. role names, single tokens as the real vocabulary has
    them), `specials` special ones; each must land on its pinned id."""
    vocab = {ch: byte for byte, ch in _bytes_to_unicode().items()}
    assert len(vocab) == NUM_BYTE_TOKENS
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    for word, token_id in words.items():
        assert core.add_tokens([AddedToken(word, normalized=False)]) == 1
        assert core.token_to_id(word) == token_id, word
    for text, token_id in specials.items():
        core.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        assert core.token_to_id(text) == token_id, text
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=eos_token,
        pad_token=pad_token,
        chat_template=chat_template,
        model_max_length=4096,
    )
