"""Prefix caching through the whole pipeline: the turns of a conversation, each resending the
history, equal the same turns with caching off byte for byte (tokens, talker inputs, codec codes,
audio), colocated and P/D, streamed between stages and not, alone and all at once; the later
turns really reuse the history's blocks, and in P/D only the blocks the decode side lacks move."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import yaml

from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR

from test_pd_equivalence import DTYPE, _per_token_kv_bytes, differences

pytestmark = [pytest.mark.slow, pytest.mark.exactness]
COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"


def _variant(tmp_path_factory, path, *, caching=True, streamed=True):
    raw = yaml.safe_load(path.read_text())
    raw["async_chunk"] = streamed
    for stage in raw["stage_args"]:
        stage["engine_args"]["dtype"] = DTYPE  # float32, or scripts/test.sh's bfloat16 run
        if stage["engine_args"]["model_stage"] == "thinker":
            stage["engine_args"]["enable_prefix_caching"] = caching
    out = tmp_path_factory.mktemp("prefix") / f"{path.stem}-{caching}-{streamed}.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with Omni(
        stage_configs_path=_variant(tmp_path_factory, COLOCATED, caching=False), keep_stage_outputs=True
    ) as omni:
        yield omni


@pytest.fixture(scope="module", params=["colocated", "pd", "pd_whole"])
def cached(request, tmp_path_factory):
    path = COLOCATED if request.param == "colocated" else PD
    config = _variant(tmp_path_factory, path, streamed=request.param != "pd_whole")
    with Omni(stage_configs_path=config, keep_stage_outputs=True) as omni:
        yield omni
        counts = omni.debug_state_counts()
        assert all(v == 0 for v in counts.values()), counts


SYSTEM = "You are a helpful voice assistant. Keep every answer short and friendly. " * 3


def _turns(count: int) -> list[list[dict]]:
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for turn in range(count):
        messages = messages + [{"role": "user", "content": f"Tell me fact number {turn} about the sea."}]
        turns.append(messages)
        messages = messages + [{"role": "assistant", "content": f"Fact {turn}: it is wet."}]
    return turns


_want: dict[int, object] = {}


def _reference_turn(reference, turn: int, messages):
    if turn not in _want:
        _want[turn] = reference.generate([messages])[0]
        assert _want[turn].metrics["prefix_cached_tokens"] == 0
    return _want[turn]


def test_each_turn_equals_the_uncached_pipeline_and_reuses_the_history(reference, cached):
    turns = _turns(3)
    for turn, messages in enumerate(turns):
        got = cached.generate([messages])[0]
        want = _reference_turn(reference, turn, messages)
        assert differences(reference, want, cached, got) == [], turn
        hit = got.metrics["prefix_cached_tokens"]
        if turn == 0:
            assert hit % 16 == 0  # whatever earlier tests left cached, in whole blocks
        else:  # the system prompt and the earlier turns came from the cache
            before = len(_reference_turn(reference, turn - 1, turns[turn - 1]).prompt_token_ids)
            assert hit >= before - 16
            if cached.pd_pair:  # and the decode side held them: only the rest moved
                reused = got.metrics["kv_reused_tokens"]
                assert reused >= before - 16
                moved = got.metrics["kv_bytes_transferred"]
                assert moved == (len(got.prompt_token_ids) - reused) * _per_token_kv_bytes(cached)
                assert got.metrics["kv_bytes_reused"] == reused * _per_token_kv_bytes(cached)


def test_turns_all_at_once_equal_the_uncached_pipeline(reference, cached):
    turns = _turns(3)
    futures = [asyncio.run_coroutine_threadsafe(cached.engine.generate(m), cached._loop) for m in turns]
    for turn, future in enumerate(futures):
        got = future.result(300)
        assert differences(reference, _reference_turn(reference, turn, turns[turn]), cached, got) == []


def _audio_turns(count: int) -> list[list[dict]]:
    """Spoken turns: each user turn carries a clip, and every turn resends the earlier clips."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for turn in range(count):
        samples = np.arange(12_000 + 4_000 * turn) / 16_000
        clip = (0.3 * np.sin(2 * np.pi * (440 + 220 * turn) * samples)).astype(np.float32)
        messages = messages + [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"What is sound {turn}?"},
                    {"type": "audio", "audio": clip},
                ],
            }
        ]
        turns.append(messages)
        messages = messages + [{"role": "assistant", "content": f"Sound {turn} is a tone."}]
    return turns


def test_spoken_turns_equal_the_uncached_pipeline_and_reuse_the_earlier_audio(reference, cached):
    """The history's clips are neither encoded nor prefilled again, nor moved again in P/D."""
    turns = _audio_turns(3)
    audio_id = cached.model_config.thinker_config.audio_token_id
    for turn, messages in enumerate(turns):
        got = cached.generate([messages])[0]
        want = _reference_turn(reference, ("audio", turn), messages)
        assert differences(reference, want, cached, got) == [], turn
        if turn:
            before = _reference_turn(reference, ("audio", turn - 1), turns[turn - 1]).prompt_token_ids
            reached = len(before) // 16 * 16  # every full block of the turn before
            assert reached > before.index(audio_id)  # blocks holding audio among them
            assert got.metrics["prefix_cached_tokens"] >= reached
            if cached.pd_pair:
                assert got.metrics["kv_reused_tokens"] >= reached


def test_negative_control_another_conversation_differs(reference, cached):
    turns = _turns(2)
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Something else?"}]
    got = cached.generate([other])[0]
    assert got.metrics["prefix_cached_tokens"] > 0  # the system prompt, shared
    assert differences(reference, _reference_turn(reference, 1, turns[1]), cached, got) != []
