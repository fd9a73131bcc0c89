"""Cross-engine P/D: an unmodified vLLM thinker prefill engine feeds omni-pd's hf thinker decode
engine (stage_configs/ci/qwen3_omni_tiny_vllm_p_hf_d.yaml; docs/cross_engine_pd.md).

- On held prompts (text and audio) the mixed pipeline's greedy thinker tokens and audio bytes
  equal the vLLM-colocated and the hf-colocated pipelines' wherever those two agree.
- Negative control: one value of one block pulled from vLLM, perturbed before its translation,
  changes the output (vLLM's protocol carries no checksum to notice it).
- A second prompt sharing a prefix moves only the blocks the hf side lacks, found by vLLM's keys:
  an exact count.
- A pull that misses its window fails the handoff with KVMissError: counted toward the pair's
  breaker, answered by the fallback (the hf decode leg prefills the prompt itself), equal output.
- Nothing is left held on any stage afterwards (every stage's /debug/state counts are zero).

One pipeline of each kind per module; the held prompts' colocated outputs are shared with
test_hf_p_vllm_d.py (cross_engine_refs.py). Needs vLLM (`OMNI_PD_VLLM=1 bash scripts/setup.sh`).
"""

from __future__ import annotations

import time

import pytest

from vllm_required import require_vllm

require_vllm()

from cross_engine_refs import (  # noqa: E402, F401 - fixtures
    BS,
    CI,
    assert_equals_both_colocated,
    chat_ids,
    hf_colocated,
    no_leaks,
    pipeline,
    run,
    vllm_colocated,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mixed():
    yield from pipeline("mixed", CI / "qwen3_omni_tiny_vllm_p_hf_d.yaml")


@pytest.mark.parametrize("case", ["text", "audio"])
def test_the_mixed_pair_equals_both_colocated_pipelines(mixed, request, case):
    got = run(mixed, "vllm_p_hf_d", case)
    assert_equals_both_colocated(request, got, case)
    # The prompt's KV came from vLLM, every block of it, over vLLM's protocol.
    assert got.metrics["kv_path"] == "vllm-mooncake"
    assert got.metrics["kv_blocks_transferred"] == -(-len(got.prompt_token_ids) // BS)


def test_negative_control_a_perturbed_vllm_block_changes_the_output(mixed, hf_colocated):
    prompt = "Name three colours of the sea at dusk, and say why each one appears."  # not cached
    want = hf_colocated.generate([prompt], use_tqdm=False)[0]
    mixed.control(1, "arm_fault", fault="vllm_pull_corruption", block_index=0, delta=0.5)
    corrupted = mixed.generate([prompt], use_tqdm=False)[0]
    assert corrupted.metrics["kv_blocks_transferred"] >= 1
    assert (corrupted.token_ids, corrupted.audio_sha256) != (want.token_ids, want.audio_sha256)
    clean = mixed.generate([prompt], use_tqdm=False)[0]  # the next one is clean (nothing cached)
    assert (clean.token_ids, clean.audio_sha256) == (want.token_ids, want.audio_sha256)


def test_a_prompt_sharing_a_prefix_moves_only_the_missing_blocks(mixed, hf_colocated):
    # Byte-level tokenizer: one ASCII character, one token. The two prompts share their first
    # 2 full blocks and no third.
    first = chat_ids(mixed, "a" * 70 + " - what comes first, the tide or the moon?")
    second = chat_ids(mixed, "a" * 70 + " ; and which one of them is later?")
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert shared // BS == 2, shared
    a = mixed.generate([{"prompt_token_ids": first}], use_tqdm=False)[0]
    assert a.metrics["kv_blocks_transferred"] == -(-len(first) // BS)
    assert a.metrics.get("kv_reused_tokens", 0) == 0
    b = mixed.generate([{"prompt_token_ids": second}], use_tqdm=False)[0]
    # The first 2 blocks are found under vLLM's keys: exactly the rest move.
    assert b.metrics["kv_reused_tokens"] == 2 * BS
    assert b.metrics["kv_blocks_transferred"] == -(-len(second) // BS) - 2
    want = hf_colocated.generate([{"prompt_token_ids": second}], use_tqdm=False)[0]
    assert (b.token_ids, b.audio_sha256) == (want.token_ids, want.audio_sha256)


def test_a_missed_window_counts_toward_the_breaker_and_falls_back(mixed, hf_colocated):
    prompt = "What does the wind do to the waves, and why?"  # not cached on the decode side
    want = hf_colocated.generate([prompt], use_tqdm=False)[0]
    failures, fallbacks = mixed.engine.handoff_failures, mixed.engine.fallbacks
    mixed.control(1, "arm_fault", fault="vllm_pull_miss")
    got = mixed.generate([prompt], use_tqdm=False)[0]
    assert (mixed.engine.handoff_failures, mixed.engine.fallbacks) == (failures + 1, fallbacks + 1)
    assert (got.token_ids, got.audio_sha256) == (want.token_ids, want.audio_sha256)
    assert "kv_path" not in got.metrics  # the decode leg computed the prompt
    # The missed pull's staging is quarantined until the producer's answer ends it (bounded).
    deadline = time.monotonic() + 10
    while (
        mixed.control(1, "debug_state_counts")["kv.vllm_staging_blocks_held"] and time.monotonic() < deadline
    ):
        time.sleep(0.05)  # polling a condition under a deadline
