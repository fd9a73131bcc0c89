"""Token sampling shared by every hf stage that samples text tokens.

Each step draws from its own generator seeded by (seed, step). A step's draw then does not depend on
how many draws came before it in this process, which is what lets a decode engine continue a request
whose first token was sampled by a prefill engine in another process and still match a colocated run.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

import torch
import xxhash

from ..sampling import SamplingParams


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + step) % (2**63))


def step_uniform(seed: int, key: int) -> float:
    """A uniform number in [0, 1) for draw `key` of a request seeded `seed`: a hash of the pair
    (xxh3-64), so a draw depends on (seed, key) only, like `step_generator`, at a microsecond
    a draw rather than a torch generator's ~10 (a batched talker makes four draws per row per
    step). 24 bits: every value is exact in float32."""
    word = xxhash.xxh3_64_intdigest(struct.pack("<qq", int(seed) % (2**63), int(key)))
    return (word >> 40) / float(1 << 24)


def _apply_repetition_penalty(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    # vLLM semantics: tokens present in the prompt or the output are divided (positive logits) or
    # multiplied (negative logits) by the penalty.
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, step: int, seen_token_ids: Sequence[int]
) -> int:
    """Pick the next token from one position's logits ([vocab], float32). Sampling runs on the
    host (logits on a GPU are copied first): the per-step generators are host generators, and
    the same logits then give the same token on any device."""
    logits = _apply_repetition_penalty(logits.float().cpu(), seen_token_ids, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, keep)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    seed = params.seed if params.seed is not None else 0
    return int(torch.multinomial(probs, 1, generator=step_generator(seed, step)).item())


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    seen_token_ids: Callable[[int], Sequence[int]],
) -> list[int]:
    """`sample_next_token` for each row of `logits` ([B, vocab]); `seen_token_ids(b)` gives row
    b's ids for the repetition penalty, asked for only where a row samples on its own. Greedy rows
    without a penalty are a plain argmax: one for all of them, the same picks as row by row."""
    picks: list[int | None] = [None] * len(params)
    plain = [b for b, p in enumerate(params) if p.greedy and p.repetition_penalty == 1.0]
    if plain:
        for b, token in zip(plain, torch.argmax(logits[plain].float(), dim=-1).tolist()):
            picks[b] = token
    for b, p in enumerate(params):
        if picks[b] is None:
            picks[b] = sample_next_token(logits[b], p, steps[b], seen_token_ids(b))
    return picks  # type: ignore[return-value]
