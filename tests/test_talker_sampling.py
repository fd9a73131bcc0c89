"""The talker's row sampler (`talker_runner.sample_rows`): it draws from the distribution that
temperature, top-k and top-p define, only ever picks an allowed token, gives a row the same pick
alone or in any mixed batch, and depends on the request's seed and the draw's key."""

import torch

from omni_pd.models.codec_sampling import RowSampling, sample_rows


def _row(temperature=1.0, top_k=0, top_p=1.0, seed=0, key=0, greedy=False):
    return RowSampling(greedy, temperature, top_k, top_p, seed, key)


def _logits(seed=0, vocab=40):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_draws_follow_the_warped_distribution():
    logits = _logits()
    temperature, top_k = 0.8, 12
    allowed = torch.topk(logits, top_k).indices
    want = torch.zeros_like(logits)
    want[allowed] = torch.softmax(logits[allowed] / temperature, dim=0)
    draws = 6000
    picks = sample_rows(
        logits.expand(draws, -1).contiguous(), [_row(temperature, top_k, key=k) for k in range(draws)]
    )
    seen = torch.bincount(torch.tensor(picks), minlength=logits.numel()).float() / draws
    assert set(picks) <= set(allowed.tolist())
    assert (seen - want).abs().max() < 0.025, (seen - want).abs().max()


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log()
    picks = sample_rows(logits.expand(2000, -1).contiguous(), [_row(top_p=0.8, key=k) for k in range(2000)])
    assert set(picks) == {0, 1, 2}  # 0.5 + 0.25 < 0.8: the third is needed, the fourth is not
    one = sample_rows(logits.expand(200, -1).contiguous(), [_row(top_p=0.3, key=k) for k in range(200)])
    assert set(one) == {0}  # at least one token stays


def test_a_row_picks_the_same_alone_and_in_a_mixed_batch():
    specs = [
        _row(0.9, 50, 1.0, seed=1, key=3),
        _row(greedy=True),
        _row(1.0, 0, 0.8, seed=2, key=7),
        _row(0.7, 5, 0.9, seed=3, key=1),
        _row(1.2, 50, 0.8, seed=4, key=9),
    ]
    scores = torch.stack([_logits(i, vocab=128) for i in range(len(specs))])
    together = sample_rows(scores, specs)
    alone = [sample_rows(scores[i : i + 1], [spec])[0] for i, spec in enumerate(specs)]
    assert together == alone
    assert together[1] == int(scores[1].argmax())
    reordered = sample_rows(scores.flip(0), specs[::-1])
    assert reordered == together[::-1]


def test_a_draw_depends_on_the_seed_and_the_key():
    logits = _logits(vocab=1000).expand(64, -1).contiguous()
    base = sample_rows(logits, [_row(seed=5, key=k) for k in range(64)])
    assert base == sample_rows(logits, [_row(seed=5, key=k) for k in range(64)])
    assert base != sample_rows(logits, [_row(seed=6, key=k) for k in range(64)])
    assert base != sample_rows(logits, [_row(seed=5, key=k + 1) for k in range(64)])
