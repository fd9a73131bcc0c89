"""Prefix caching in the hf thinker: content-addressed blocks (chained hashes, checked tokens),
reference counts and LRU eviction in the block pool, and a prompt prefilled over cached blocks
that is bit for bit the same prompt prefilled whole: KV, first token, talker rows, decode."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

torch.set_num_threads(1)  # as in a stage worker

from omni_pd.engines.core.prefix_cache import ROOT_HASH, PrefixCache, block_hash, multimodal_extra_keys
from omni_pd.kv.layout import BlockLayout
from omni_pd.kv.pool import BlockPool
from omni_pd.models.qwen3_omni.prompt import OmniPrompt, PromptBuilder
from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.sampling import SamplingParams

from test_thinker_engine import _engine, _run_together, runner  # noqa: F401

pytestmark = pytest.mark.exactness

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
        prompts.append(
            ThinkerPrompt(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        )
        messages.append({"role": "assistant", "content": f"answer {turn}."})
    return prompts


def _identical(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and torch.equal(a.prompt_embeds, b.prompt_embeds)
        and torch.equal(a.prompt_hidden, b.prompt_hidden)
        and torch.equal(a.output_embeds, b.output_embeds)
        and torch.equal(a.output_hidden, b.output_hidden)
    )


def _uncached_and_cached(runner, prompts, params, together: bool):
    """The turns through an engine with caching off, and through one with it on: one after
    another, or (`together`) all at once after the first, so that one batched pass has hits
    and misses. Returns both outputs and the caching engine."""
    uncached = _engine(runner, enable_prefix_caching=False)
    want = [_one(uncached, p, q, "u") for p, q in zip(prompts, params)]
    cached = _engine(runner)
    if together:
        first = _one(cached, prompts[0], params[0], "c")
        rest, _ = _run_together(cached, prompts[1:], params[1:])
        got = [first, *rest]
    else:
        got = [_one(cached, p, q, "c") for p, q in zip(prompts, params)]
    return want, got, cached


def _one(engine, prompt, params, name):
    outputs, _ = _run_together(engine, [prompt], [params])
    return outputs[0]


@pytest.mark.parametrize("together", [False, True])
def test_turns_prefilled_over_cached_blocks_equal_uncached_bit_for_bit(runner, tiny_tokenizer, together):
    prompts = _conversation(tiny_tokenizer, 4)
    params = [SamplingParams(temperature=0, max_tokens=8)] * len(prompts)
    want, got, cached = _uncached_and_cached(runner, prompts, params, together)
    for turn, (a, b) in enumerate(zip(want, got)):
        assert _identical(a, b), turn
        assert a.metrics["prefix_cached_tokens"] == 0
    hits = [o.metrics["prefix_cached_tokens"] for o in got]
    assert hits[0] == 0 and all(h >= 3 * 16 for h in hits[1:]), hits  # the history came cached
    assert cached.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
    cached.kv.prefix.check()


def test_negative_control_a_changed_cached_block_is_noticed(runner, tiny_tokenizer):
    """The comparison above can fail: the same turns, with one byte of a cached block flipped
    before the next turn reuses it, no longer equal the uncached run."""
    prompts = _conversation(tiny_tokenizer, 2)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = _one(_engine(runner, enable_prefix_caching=False), prompts[1], params, "u")
    engine = _engine(runner)
    _one(engine, prompts[0], params, "c0")
    found = engine.kv.prefix.match(prompts[1].prompt_token_ids)
    engine.kv.cache.data[found[0], 0, 0, 0, 0, 0] += 1.0
    engine.kv.cache.release(found)
    got = _one(engine, prompts[1], params, "c1")
    assert got.metrics["prefix_cached_tokens"] > 0 and not _identical(want, got)


def test_forced_collisions_in_the_engine_never_reuse_another_prompts_blocks(runner, tiny_tokenizer):
    prompts = _prompts_of(
        tiny_tokenizer,
        [
            "the first prompt, long enough for two blocks " * 2,
            "another prompt entirely, also two blocks long " * 2,
        ],
    )
    params = SamplingParams(temperature=0, max_tokens=8)
    want = _one(_engine(runner, enable_prefix_caching=False), prompts[1], params, "u")
    engine = _engine(runner)
    engine.kv.prefix._hash = lambda parent, ids, extra: b"same" * 4  # every block collides
    _one(engine, prompts[0], params, "c0")
    got = _one(engine, prompts[1], params, "c1")
    assert got.metrics["prefix_cached_tokens"] == 0 and _identical(want, got)
    # The first prompt again does hit, through the same colliding hash: the collision was in
    # play, and only the token check kept the second prompt off the first one's blocks.
    assert _one(engine, prompts[0], params, "c2").metrics["prefix_cached_tokens"] > 0


def _prompts_of(tokenizer, texts):
    return [
        ThinkerPrompt(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]


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
    engine.kv.prefix.check()
    assert engine.kv.prefix.evictions > 0 and engine.kv.cache.num_free == 48
    last = conversations[0][-1]
    want = _one(_engine(runner, enable_prefix_caching=False), last, params, "u")
    assert _identical(want, _one(engine, last, params, "end"))


# ---- prompts with audio ------------------------------------------------------------------------


def test_extra_keys_name_the_audio_inputs_each_block_overlaps():
    spans = [(10, 40, b"A"), (40, 41, b"B"), (70, 80, b"C")]
    keys = multimodal_extra_keys(spans, 100, BS)  # 6 full blocks; positions 96.. are no block
    assert keys == [b"A", b"A", b"AB", b"", b"C", b""]
    assert multimodal_extra_keys([], 40, BS) == [b"", b""]


def _tone(freq: float, samples: int) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * freq * np.arange(samples) / 16_000)).astype(np.float32)


def _audio_conversation(builder, turns: int, sounds=None):
    """A conversation whose user turns each carry a clip: each prompt holds the ones before."""
    sounds = sounds or [_tone(440 + 220 * t, 12_000 + 4_000 * t) for t in range(turns)]
    messages = [{"role": "system", "content": "You answer briefly and kindly. " * 6}]
    prompts = []
    for turn in range(turns):
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"sound {turn}?"},
                    {"type": "audio", "audio": sounds[turn]},
                ],
            }
        )
        prompts.append(builder.build(OmniPrompt(messages=list(messages))))
        messages.append({"role": "assistant", "content": f"a tone, number {turn}."})
    return prompts


@pytest.fixture(scope="module")
def builder(tiny_model, tiny_tokenizer):
    return PromptBuilder(tiny_tokenizer, tiny_model.config.thinker_config)


def test_a_clips_features_do_not_depend_on_the_other_clips_of_the_prompt(builder):
    """Padded together, a short clip's last frames would see the longer clip's padding; each
    clip's features are its own, so a clip resent in a later turn hashes the same."""
    short, long = _tone(440, 8_000), _tone(660, 20_000)
    alone = builder.build(
        OmniPrompt(messages=[{"role": "user", "content": [{"type": "audio", "audio": short}]}])
    )
    both = builder.build(
        OmniPrompt(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "audio", "audio": short}, {"type": "audio", "audio": long}],
                }
            ]
        )
    )
    frames = int(alone.feature_attention_mask.sum())
    assert torch.equal(both.input_features[0, :, :frames], alone.input_features[0, :, :frames])
    assert int(both.feature_attention_mask[0].sum()) == frames
    assert not both.input_features[0, :, frames:].any()  # padding: zeros, masked out


def test_audio_clips_are_placed_on_their_placeholders_and_keyed_by_their_features(runner, builder):
    [first, second] = _audio_conversation(builder, 2)
    clips = runner.audio_clips(second)
    audio_id = runner.thinker.config.audio_token_id
    assert len(clips) == 2 and runner.audio_clips(first)[0] == clips[0]  # the same clip, resent
    for clip in clips:
        assert set(second.prompt_token_ids[clip.start : clip.end]) == {audio_id}
    assert sum(c.length for c in clips) == second.prompt_token_ids.count(audio_id)
    assert clips[0].key != clips[1].key
    # A truncated placeholder run is refused by name.
    broken = ThinkerPrompt(
        [t for i, t in enumerate(second.prompt_token_ids) if i != clips[1].start],
        second.input_features,
        second.feature_attention_mask,
    )
    with pytest.raises(ValueError, match="audio input 1 needs"):
        runner.audio_clips(broken)


@pytest.mark.parametrize("together", [False, True])
def test_audio_turns_prefilled_over_cached_blocks_equal_uncached_bit_for_bit(runner, builder, together):
    """The clips of earlier turns come from the cache (their KV, layer-0 rows holding the encoder
    output, and accept-layer rows), and only the new turn's clip is encoded."""
    prompts = _audio_conversation(builder, 3)
    params = [SamplingParams(temperature=0, max_tokens=6)] * len(prompts)
    want, got, cached = _uncached_and_cached(runner, prompts, params, together)
    for turn, (a, b) in enumerate(zip(want, got)):
        assert _identical(a, b), turn
    # Each turn reused every full block of the turn cached before it (turns prefilled in one
    # pass cannot reuse each other), the blocks of its clips included.
    hits = [o.metrics["prefix_cached_tokens"] for o in got]
    assert hits[0] == 0, hits
    for turn in (1, 2):
        earlier = prompts[0 if together else turn - 1]
        before = len(earlier.prompt_token_ids) // BS * BS
        assert hits[turn] >= before > runner.audio_clips(earlier)[-1].start, hits
    cached.kv.prefix.check()
    assert cached.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def test_negative_control_another_clip_of_the_same_length_is_not_reused(runner, builder):
    """Same token ids, other audio: the blocks up to the clip are reused, the clip's are not,
    and the answer is that of the other audio (not of the cached one)."""
    sounds = [_tone(440, 12_000), _tone(660, 16_000)]
    first, second = _audio_conversation(builder, 2, sounds)
    other_first, other_second = _audio_conversation(builder, 2, [_tone(500, 12_000), sounds[1]])
    assert other_second.prompt_token_ids == second.prompt_token_ids
    assert not torch.equal(other_second.input_features, second.input_features)
    params = SamplingParams(temperature=0, max_tokens=6)
    uncached = _engine(runner, enable_prefix_caching=False)
    want, want_other = _one(uncached, second, params, "u"), _one(uncached, other_second, params, "v")
    assert not _identical(want, want_other)  # the audio matters to the answer
    engine = _engine(runner)
    _one(engine, first, params, "c0")
    got = _one(engine, other_second, params, "c1")
    clip = runner.audio_clips(other_second)[0]
    assert got.metrics["prefix_cached_tokens"] == clip.start // BS * BS  # up to the clip's block
    assert _identical(want_other, got) and not _identical(want, got)
    engine.kv.prefix.check()


# ---- blocks named by vLLM's keys (prefix_caching_hash_algo) ----------------------------------


def test_every_vllm_hash_algo_hits_the_same_blocks_with_the_same_outputs(runner, tiny_tokenizer, monkeypatch):
    """Naming blocks by vLLM's keys changes their names only: under each algorithm the turns of a
    conversation hit exactly as many cached tokens as with omni-pd's own naming, with the same
    bits out. The names do differ (negative control: the comparison sees the naming)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # the xxhash algorithms: a seed both sides can know
    prompts = _conversation(tiny_tokenizer, 3)
    params = SamplingParams(temperature=0, max_tokens=4)

    def turns(**engine_args):
        engine = _engine(runner, **engine_args)
        outputs = [_one(engine, p, params, f"t{i}") for i, p in enumerate(prompts)]
        assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
        engine.kv.prefix.check()
        return outputs, engine.kv.prefix.block_hashes(prompts[-1].prompt_token_ids)

    want, own_names = turns()
    want_hits = [o.metrics["prefix_cached_tokens"] for o in want]
    assert want_hits[0] == 0 and all(h > 0 for h in want_hits[1:])
    names = {}
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        got, names[algo] = turns(prefix_caching_hash_algo=algo)
        assert [o.metrics["prefix_cached_tokens"] for o in got] == want_hits, algo
        assert all(_identical(a, b) for a, b in zip(want, got)), algo
    assert len({tuple(n) for n in [own_names, *names.values()]}) == 5  # five namings, five names


def test_audio_blocks_under_vllm_keys_hit_only_the_same_clip(runner, builder, monkeypatch):
    """Under vLLM naming a block holding audio is keyed by its clip (omni-pd's content key under
    its own tag): the same clip hits, another clip of the same length does not."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    sounds = [_tone(440, 12_000), _tone(660, 16_000)]
    first, second = _audio_conversation(builder, 2, sounds)
    _, other_second = _audio_conversation(builder, 2, [_tone(500, 12_000), sounds[1]])
    params = SamplingParams(temperature=0, max_tokens=4)
    engine = _engine(runner, prefix_caching_hash_algo="xxhash_cbor")
    _one(engine, first, params, "c0")
    clip = runner.audio_clips(second)[0]
    full = len(first.prompt_token_ids) // BS * BS
    assert full > clip.start  # the first turn's cached blocks include the clip's
    assert _one(engine, second, params, "c1").metrics["prefix_cached_tokens"] == full
    engine = _engine(runner, prefix_caching_hash_algo="xxhash_cbor")
    _one(engine, first, params, "c0")
    assert _one(engine, other_second, params, "c1").metrics["prefix_cached_tokens"] == clip.start // BS * BS
    engine.kv.prefix.check()
