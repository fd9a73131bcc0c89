"""transformers' logits processors and warpers for a codec talker's next code, for a batch of rows,
computed so that a row's pick does not depend on the batch: the repetition penalty, suppressed
tokens and a forbidden EOS elementwise per (row, id); greedy, or temperature, top-k and top-p
along each row and a draw keyed by the request's seed and position (never the global RNG).
Shared by the omni models' talkers (Qwen3-Omni's code0, Qwen2.5-Omni's code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omni_pd.engines.sampler import step_uniform


def process_code0_scores(
    logits: torch.Tensor,
    generated: list[list[int]],
    penalties: list[float],
    suppress_mask: torch.Tensor,
    no_eos: list[bool],
    eos: int | Sequence[int],
) -> torch.Tensor:
    """transformers' logits processors for the talker, for a batch of rows ([B, vocab]): the
    repetition penalty of each row over its generated ids (the prompt is embeddings only, so
    only they count), then suppress_tokens, and the codec EOS (one id or several) for the rows in
    `no_eos`.
    Elementwise per (row, id), so a row's scores do not depend on the others; one gather and
    one scatter for the whole batch."""
    scores = logits.float()
    rows: list[int] = []
    ids: list[int] = []
    factors: list[float] = []
    for row, (seen, penalty) in enumerate(zip(generated, penalties)):
        if penalty != 1.0 and seen:
            rows.extend([row] * len(seen))
            ids.extend(seen)
            factors.extend([penalty] * len(seen))
    if rows:
        where = (torch.tensor(rows), torch.tensor(ids))
        penalty = torch.tensor(factors, dtype=scores.dtype)
        picked = scores[where]
        scores = scores.index_put(where, torch.where(picked < 0, picked * penalty, picked / penalty))
    scores = scores.masked_fill(suppress_mask, float("-inf"))
    if any(no_eos):
        for eos_id in [eos] if isinstance(eos, int) else eos:
            scores[torch.tensor(no_eos), eos_id] = float("-inf")
    return scores


@dataclass(frozen=True)
class RowSampling:
    """How one row of a batch is sampled: greedy, or transformers' warpers (temperature, top-k,
    top-p, in that order) and a draw keyed by the request's seed and `key`."""

    greedy: bool
    temperature: float
    top_k: int  # 0: off
    top_p: float
    seed: int
    key: int


def sample_rows(scores: torch.Tensor, rows: list[RowSampling]) -> list[int]:
    """One pick per row of `scores` ([B, vocab]). Greedy rows take the argmax. Sampled rows are
    warped and drawn on their top-k candidates only (the whole vocabulary where top-k is off):
    temperature, then top-k, then top-p (a candidate stays while the mass of the better ones is
    below top_p, at least one), then an inverse-CDF draw with the row's uniform number. Rows are
    grouped by candidate count and every op works along a row (top-k, softmax, cumsum, search),
    so a row's pick is the same in a batch of one or of many."""
    picks = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        for i, pick in zip(greedy, torch.argmax(scores[greedy], dim=-1).tolist()):
            picks[i] = pick
    vocab = scores.shape[1]
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.greedy:
            groups.setdefault(min(r.top_k, vocab) if r.top_k > 0 else vocab, []).append(i)
    for width, members in groups.items():
        for i, pick in zip(members, _draw(scores[members], [rows[i] for i in members], width)):
            picks[i] = pick
    return picks


def _draw(scores: torch.Tensor, specs: list[RowSampling], width: int) -> list[int]:
    """Draws for rows that all keep `width` candidates."""
    temperatures = [r.temperature for r in specs]
    if any(t != 1.0 for t in temperatures):
        scores = scores / torch.tensor(temperatures, dtype=scores.dtype).unsqueeze(1)
    values, candidates = torch.topk(scores, width, dim=-1)  # best first
    probs = torch.softmax(values, dim=-1)
    if any(r.top_p < 1.0 for r in specs):
        before = probs.cumsum(dim=-1) - probs
        drop = before >= torch.tensor([r.top_p for r in specs], dtype=probs.dtype).unsqueeze(1)
        drop[:, 0] = False
        probs = torch.softmax(values.masked_fill(drop, float("-inf")), dim=-1)
    # One uniform number per row, a hash of the request's seed and the draw's key, then one
    # row-wise search for all rows (a multinomial call per row was a fifth of a talker step; a
    # torch generator per row, a tenth).
    uniform = torch.tensor([step_uniform(r.seed, r.key) for r in specs], dtype=probs.dtype)
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True)
    # The candidates with mass are a prefix (best first, the dropped ones last); past it only
    # when rounding makes the draw equal the total: then the last candidate with mass.
    chosen = torch.minimum(chosen, (probs > 0).sum(dim=-1, keepdim=True) - 1)
    return candidates.gather(1, chosen).squeeze(1).tolist()
