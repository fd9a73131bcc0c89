"""What every stage that generates text tokens shares: when a request stops, its text, and how
its next token is drawn (engines/sampler.py: a generator per (seed, step), so a decode leg
continues a prefill leg's request exactly as a colocated engine would)."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ...sampling import SamplingParams
from ..sampler import sample_next_token, sample_next_tokens
from .request import EngineRequest


class TextStops:
    """End-of-sequence ids, stop ids, stop strings and max_tokens, with vLLM's meanings."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def finish_reason(self, tokens: list[int], params: SamplingParams) -> str | None:
        last = tokens[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in params.stop_token_ids:
            return "stop"
        if params.stop and self._stop_string_at(tokens, params) is not None:
            return "stop"
        if len(tokens) >= params.max_tokens:
            return "length"
        return None

    def _stop_string_at(self, tokens: list[int], params: SamplingParams) -> int | None:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in params.stop if s and s in text]
        if not hits:
            return None
        index, stop = min(hits)
        return index + len(stop) if params.include_stop_str_in_output else index

    def detokenize(self, tokens: list[int], params: SamplingParams) -> str:
        if not params.detokenize:
            return ""
        ids = [t for t in tokens if t not in self.eos_token_ids and t not in params.stop_token_ids]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = self._stop_string_at(tokens, params) if params.stop else None
        return text if cut is None else text[:cut]


def sample_tokens(requests: Sequence[EngineRequest], logits: torch.Tensor, first: bool) -> list[int]:
    """Each request's next token from its row of `logits`: the repetition penalty counts its
    prompt's ids and its output's, the draw is keyed by (seed, step)."""
    if first:
        return [
            sample_next_token(row, r.params, step=0, seen_token_ids=r.token_ids or [])
            for r, row in zip(requests, logits)
        ]
    return list(
        sample_next_tokens(
            logits,
            [r.params for r in requests],
            [len(r.tokens) for r in requests],
            lambda b: requests[b].seen_token_ids,
        )
    )
