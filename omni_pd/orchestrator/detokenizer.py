"""Text deltas for streamed requests, from the token ids a text stage streams."""

from __future__ import annotations

from typing import AbstractSet

from ..sampling import SamplingParams


class IncrementalDetokenizer:
    """Decodes the growing token list and hands out only text that can no longer change: text
    that may still become part of a stop string, or an incomplete UTF-8 sequence, is held back."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: AbstractSet[int]):
        self.tokenizer = tokenizer
        self.params = params
        self.hidden = set(eos_token_ids) | set(params.stop_token_ids)
        self.tokens: list[int] = []
        self.sent = ""

    def _text(self) -> str:
        text = self.tokenizer.decode(
            [t for t in self.tokens if t not in self.hidden], skip_special_tokens=True
        )
        for stop in self.params.stop:
            if stop and stop in text:
                cut = text.index(stop) + (len(stop) if self.params.include_stop_str_in_output else 0)
                text = text[:cut]
        return text

    def add(self, token_ids: list[int]) -> str:
        self.tokens.extend(token_ids)
        text = self._text()
        # Hold back a trailing replacement char (half a UTF-8 character) and any tail that is a
        # prefix of a stop string.
        stable = len(text.rstrip("\ufffd"))
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, stable), 0, -1):
                if text[:stable].endswith(stop[:n]):
                    stable -= n
                    break
        if not text.startswith(self.sent) or stable <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) : stable], text[:stable]
        return delta
