import torch

from omni_pd.engines.sampler import sample_next_token, sample_next_tokens
from omni_pd.sampling import SamplingParams


def _logits(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = _logits()
    assert sample_next_token(logits, SamplingParams(temperature=0), 0, []) == int(logits.argmax())
    assert sample_next_token(logits, SamplingParams(temperature=1.0, top_k=1), 3, []) == int(logits.argmax())


def test_seeded_sampling_depends_only_on_seed_and_step():
    logits = _logits()
    params = SamplingParams(temperature=1.5, seed=11)
    draws = [sample_next_token(logits, params, step, []) for step in range(40)]
    # Same (seed, step) in any order gives the same token: what a decode leg relies on.
    assert [sample_next_token(logits, params, step, []) for step in reversed(range(40))] == draws[::-1]
    assert len(set(draws)) > 1
    other = [sample_next_token(logits, params.replace(seed=12), s, []) for s in range(40)]
    assert other != draws


def test_repetition_penalty_moves_the_greedy_choice():
    logits = torch.tensor([0.0, 2.0, 1.9])
    assert sample_next_token(logits, SamplingParams(temperature=0), 0, [1]) == 1
    assert sample_next_token(logits, SamplingParams(temperature=0, repetition_penalty=1.2), 0, [1]) == 2


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([5.0, 4.9, -5.0, -5.0])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    assert {sample_next_token(logits, params, s, []) for s in range(60)} <= {0, 1}


def test_a_batch_picks_what_each_row_picks_alone():
    """sample_next_tokens: plain greedy rows share one argmax, the rest sample row by row; every
    pick equals sample_next_token's for that row, and only rows that sample alone ask for their
    seen ids. The penalised greedy row is the control: its pick is not the plain argmax."""
    logits = torch.stack([_logits(seed) for seed in range(5)])
    logits[3, 7] = logits[3].max() + 0.1  # row 3's argmax, which its penalty demotes
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=5, seed=4),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0.8, top_p=0.7, seed=9),
    ]
    steps, seen = [3, 5, 0, 2, 7], {3: [7]}
    asked = []

    def seen_ids(b):
        asked.append(b)
        return seen.get(b, [])

    picks = sample_next_tokens(logits, params, steps, seen_ids)
    assert picks == [sample_next_token(logits[b], params[b], steps[b], seen.get(b, [])) for b in range(5)]
    assert sorted(asked) == [1, 3, 4]
    assert picks[3] != int(logits[3].argmax())
