"""Text deltas for streamed requests, from the token ids a text stage streams."""

from __future__ import annotations

from typing import AbstractSet

from ..sampling import SamplingParams


class IncrementalDetokenizer:
    """Hands out only text that can no longer change: text that may still become part of a stop
    string, or an incomplete UTF-8 sequence, is held back.

    Linear in the answer's length, as vLLM's detokenizer is: a step decodes only the tokens not
    yet read plus the last complete run before them as context (`prefix` .. `read`), not the
    whole list again; a run that ends in half a UTF-8 character stays unread until it completes.
    Stop strings are looked for only in text not searched yet (and the few characters before it
    a stop string could span). Its deltas are those of decoding the whole list at every step
    (tests/test_detokenizer.py compares the two on random ids)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: AbstractSet[int]):
        self.tokenizer = tokenizer
        self.params = params
        self.hidden = set(eos_token_ids) | set(params.stop_token_ids)
        self.stops = [s for s in params.stop if s]
        self.longest_stop = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []  # the visible tokens
        self.prefix = self.read = 0
        self.final = ""  # the text of ids[:read]: complete characters, it never changes
        self.searched = 0  # characters of `final` searched for stop strings, none found
        self.cut: int | None = None  # where the stop strings end the text, once one appears
        self.sent = 0  # characters handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self) -> str:
        """The whole visible text: `final` and what the unread tokens add after it."""
        if len(self.ids) == self.read:
            return self.final
        before = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        tail = window[len(before) :]
        if tail and not tail.endswith("\ufffd"):  # whole characters: read
            self.final += tail
            self.prefix, self.read = self.read, len(self.ids)
            return self.final
        return self.final + tail

    def _stop_cut(self, text: str) -> None:
        """Once a stop string appears, where it ends the text: each stop string in order, looked
        for in what the ones before left (as the whole text is cut)."""
        if self.cut is not None or not self.stops:
            return
        start = max(self.searched - self.longest_stop + 1, 0)
        if not any(stop in text[start:] for stop in self.stops):
            self.searched = len(self.final)  # the unread tail may still change
            return
        for stop in self.stops:
            if stop in text:
                text = text[: text.index(stop) + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.cut = len(text)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(t for t in token_ids if t not in self.hidden)
        text = self._text()
        self._stop_cut(text)
        if self.cut is not None:
            text = text[: self.cut]
        # Hold back a trailing replacement char (half a UTF-8 character) and any tail that is a
        # prefix of a stop string (no copy of the text: a step costs what it adds).
        stable = len(text)
        while stable and text[stable - 1] == "\ufffd":
            stable -= 1
        for stop in self.stops:
            for n in range(min(len(stop) - 1, stable), 0, -1):
                if text.endswith(stop[:n], 0, stable):
                    stable -= n
                    break
        if stable <= self.sent:
            return ""
        delta, self.sent = text[self.sent : stable], stable
        return delta
