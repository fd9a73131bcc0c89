"""Prefix caching in the hf thinker: content-addressed blocks (chained hashes, checked tokens),
reference counts and LRU eviction in the block pool, and a prompt prefilled over cached blocks
that is bit for bit the same prompt prefilled whole: KV, first token, talker rows, decode."""
from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(1)  # as in a stage worker

from omni_pd.engines.hf.prefix_cache import ROOT_HASH, PrefixCache, block_hash
from omni_pd.kv.layout import BlockLayout
from omni_pd.kv.pool import BlockPool
from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.sampling import SamplingParams

from test_thinker_engine import _engine, _run_together, runner  # noqa: F401

BS = 16


def _pool(blocks: int = 8) -> BlockPool:
    return BlockPool(BlockLayout.default_for(1, 1, 4, "float32", block_size=BS), blocks)


# ---- the cache and the pool ------------------------------------------------------------------

def test_block_hashes_chain_their_parent_tokens_and_extra_keys():
    a = block_hash(ROOT_HASH, range(16))
    assert a == block_hash(ROOT_HASH, list(range(16))) and len(a) == 16
    assert block_hash(a, range(16)) != a  # the same tokens after another block
    assert block_hash(ROOT_HASH, range(16), b"audio-digest") != a
    assert block_hash(ROOT_HASH, [*range(15), 99]) != a


def test_a_released_prompt_stays_cached_and_a_later_prompt_reuses_its_blocks():
    pool = _pool()
    cache = PrefixCache(pool)
    ids = list(range(40))  # two full blocks and 8 tokens
    blocks = pool.allocate(3)
    assert cache.register(blocks, ids) == 2
    assert cache.match(ids) == blocks[:2]  # another holder now
    assert pool.holders(blocks[0]) == 2
    pool.free(blocks)  # the first request ends: its named blocks stay, the third goes
    assert pool.num_free == 6 and cache.num_kept == 0  # the two named ones: held by the second
    pool.free(blocks[:2])
    assert cache.num_kept == 2 and pool.num_used == 0 and pool.num_free == 8
    # A prompt that shares the first block only reuses it alone.
    assert cache.match([*range(16), *range(100, 116)]) == blocks[:1]
    pool.free(blocks[:1])
    cache.check()


def test_eviction_takes_the_least_recently_used_and_never_blocks_an_allocation():
    pool = _pool(4)
    cache = PrefixCache(pool)
    prompts = [[p * 1000 + t for t in range(BS)] for p in range(3)]
    for ids in prompts:
        [block] = pool.allocate(1)
        cache.register([block], ids)
        pool.free([block])
    pool.free(cache.match(prompts[0]))  # used again: the most recent now
    assert pool.num_free == 4 and cache.num_kept == 3
    taken = pool.allocate(3)  # one free block plus two evicted: prompts 1 and 2, the oldest
    assert cache.evictions == 2
    assert cache.match(prompts[1]) == [] and cache.match(prompts[2]) == []
    kept = cache.match(prompts[0])
    assert len(kept) == 1
    cache.check()
    with pytest.raises(Exception, match="exhausted"):
        pool.allocate(1)  # the last block is held now
    pool.free(taken + kept)


def test_a_colliding_hash_never_reuses_a_block_for_other_tokens():
    pool = _pool()
    cache = PrefixCache(pool, hash_fn=lambda parent, ids, extra: b"same" * 4)  # every block collides
    first = list(range(BS))
    blocks = pool.allocate(1)
    cache.register(blocks, first)
    assert cache.match([t + 1 for t in first]) == []  # same hash, other tokens: not reused
    # Negative control: the collision is real (the same tokens hit through that same hash).
    assert cache.match(first) == blocks
    pool.free(blocks)
    pool.free(blocks)
    cache.check()


def test_soak_random_prompts_and_aborts_leave_nothing_held():
    rng = random.Random(0)
    pool = _pool(24)
    cache = PrefixCache(pool)
    system = list(range(2 * BS))
    live: list[list[int]] = []
    for step in range(500):
        if live and rng.random() < 0.45:
            pool.free(live.pop(rng.randrange(len(live))))  # finished or aborted
            continue
        ids = system + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        cached = cache.match(ids, limit=len(ids) - 1)
        need = -(-len(ids) // BS) - len(cached)
        if need > pool.num_free:
            pool.free(cached)
            continue
        blocks = cached + pool.allocate(need)
        cache.register(blocks, ids)
        live.append(blocks)
        cache.check()
    for blocks in live:
        pool.free(blocks)
    cache.check()
    assert pool.num_used == 0 and pool.num_free == 24 and cache.num_cached > 0


# ---- the engine ------------------------------------------------------------------------------

def _conversation(tokenizer, turns: int):
    """Prompts of a growing conversation: each holds the one before (a long system prompt)."""
    messages = [{"role": "system", "content": "You answer briefly and kindly. " * 6}]
    prompts = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question number {turn}, about the sea?"})
        prompts.append(ThinkerPrompt(tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False)))
        messages.append({"role": "assistant", "content": f"answer {turn}."})
    return prompts


def _identical(a, b) -> bool:
    return (a.token_ids == b.token_ids and torch.equal(a.prompt_embeds, b.prompt_embeds)
            and torch.equal(a.prompt_hidden, b.prompt_hidden)
            and torch.equal(a.output_embeds, b.output_embeds)
            and torch.equal(a.output_hidden, b.output_hidden))


def _one(engine, prompt, params, name):
    outputs, _ = _run_together(engine, [prompt], [params])
    return outputs[0]


@pytest.mark.parametrize("together", [False, True])
def test_turns_prefilled_over_cached_blocks_equal_uncached_bit_for_bit(runner, tiny_tokenizer,
                                                                        together):
    prompts = _conversation(tiny_tokenizer, 4)
    params = [SamplingParams(temperature=0, max_tokens=8)] * len(prompts)
    uncached = _engine(runner, enable_prefix_caching=False)
    want = [_one(uncached, p, q, "u") for p, q in zip(prompts, params)]
    cached = _engine(runner)
    if together:  # all turns at once after the first: hits and misses in one batched pass
        first = _one(cached, prompts[0], params[0], "c")
        rest, _ = _run_together(cached, prompts[1:], params[1:])
        got = [first, *rest]
    else:
        got = [_one(cached, p, q, "c") for p, q in zip(prompts, params)]
    for turn, (a, b) in enumerate(zip(want, got)):
        assert _identical(a, b), turn
        assert a.metrics["prefix_cached_tokens"] == 0
    hits = [o.metrics["prefix_cached_tokens"] for o in got]
    assert hits[0] == 0 and all(h >= 3 * 16 for h in hits[1:]), hits  # the history came cached
    assert uncached.debug_state_counts() == cached.debug_state_counts() == {
        "thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
    cached.cache.prefix.check()


def test_negative_control_a_changed_cached_block_is_noticed(runner, tiny_tokenizer):
    """The comparison above can fail: the same turns, with one byte of a cached block flipped
    before the next turn reuses it, no longer equal the uncached run."""
    prompts = _conversation(tiny_tokenizer, 2)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = _one(_engine(runner, enable_prefix_caching=False), prompts[1], params, "u")
    engine = _engine(runner)
    _one(engine, prompts[0], params, "c0")
    found = engine.cache.prefix.match(prompts[1].prompt_token_ids)
    engine.cache.data[found[0], 0, 0, 0, 0, 0] += 1.0
    engine.cache.release(found)
    got = _one(engine, prompts[1], params, "c1")
    assert got.metrics["prefix_cached_tokens"] > 0 and not _identical(want, got)


def test_forced_collisions_in_the_engine_never_reuse_another_prompts_blocks(runner, tiny_tokenizer):
    prompts = _prompts_of(tiny_tokenizer, ["the first prompt, long enough for two blocks " * 2,
                                           "another prompt entirely, also two blocks long " * 2])
    params = SamplingParams(temperature=0, max_tokens=8)
    want = _one(_engine(runner, enable_prefix_caching=False), prompts[1], params, "u")
    engine = _engine(runner)
    engine.cache.prefix._hash = lambda parent, ids, extra: b"same" * 4  # every block collides
    _one(engine, prompts[0], params, "c0")
    got = _one(engine, prompts[1], params, "c1")
    assert got.metrics["prefix_cached_tokens"] == 0 and _identical(want, got)
    # The first prompt again does hit, through the same colliding hash: the collision was in
    # play, and only the token check kept the second prompt off the first one's blocks.
    assert _one(engine, prompts[0], params, "c2").metrics["prefix_cached_tokens"] > 0


def _prompts_of(tokenizer, texts):
    return [ThinkerPrompt(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)) for t in texts]


def test_engine_soak_500_turns_with_random_aborts_leaves_the_pool_consistent(runner, tiny_tokenizer):
    """500 requests of growing conversations on a small pool (so cached blocks get evicted),
    some aborted while waiting or running: afterwards nothing is held, the cache's bookkeeping
    is consistent, and a last turn still equals caching off."""
    rng = random.Random(7)
    engine = _engine(runner, kv_pool_blocks=48, max_num_seqs=6)
    conversations = [_conversation(tiny_tokenizer, 6) for _ in range(3)]
    for c, turns in enumerate(conversations):  # distinct histories per conversation
        for prompt in turns:
            prompt.prompt_token_ids[3] = 48 + c
    params = SamplingParams(temperature=0, max_tokens=2)
    sent = 0
    while sent < 500 or engine.has_unfinished_requests():
        if sent < 500 and len(engine.request_ids()) < 8:
            turns = conversations[rng.randrange(3)]
            engine.add_request(f"s{sent}", turns[rng.randrange(len(turns))], params)
            sent += 1
        if engine.request_ids() and rng.random() < 0.1:
            engine.abort_request(rng.choice(engine.request_ids()))
        for out in engine.step() if engine.has_unfinished_requests() else []:
            assert out.error is None, out.error
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
    engine.cache.prefix.check()
    assert engine.cache.prefix.evictions > 0 and engine.cache.num_free == 48
    last = conversations[0][-1]
    want = _one(_engine(runner, enable_prefix_caching=False), last, params, "u")
    assert _identical(want, _one(engine, last, params, "end"))
