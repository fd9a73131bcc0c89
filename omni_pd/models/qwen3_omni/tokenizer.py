"""A byte-level tokenizer for the tiny model, built in code with the `tokenizers` library.

256 byte tokens (any UTF-8 text encodes), the role words `system`/`user`/`assistant` as single
tokens (transformers' talker hand-off finds the user turns by the token after `<|im_start|>`),
then the Qwen3-Omni special tokens, all pinned to the ids in `tiny_config.py`.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .tiny_config import NUM_BYTE_TOKENS, ROLE_TOKENS, SPECIAL_TOKENS

# Qwen's chat template, reduced to what the tiny model needs: string content or a list of
# {"type": "text"|"audio"|"input_audio"} parts; each audio part becomes one <|audio_pad|> that the
# prompt builder expands to the audio encoder's output length.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('audio', 'input_audio') -%}<|audio_start|><|audio_pad|><|audio_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
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


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: byte for byte, ch in _bytes_to_unicode().items()}  # token id == byte value
    assert len(vocab) == NUM_BYTE_TOKENS
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    for word, token_id in ROLE_TOKENS.items():
        assert core.add_tokens([AddedToken(word, normalized=False)]) == 1
        assert core.token_to_id(word) == token_id, word
    for text, token_id in SPECIAL_TOKENS.items():
        core.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        assert core.token_to_id(text) == token_id, text
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    return tokenizer
