"""Cross-engine P/D the other way round: omni-pd's hf thinker prefill engine feeds an unmodified
vLLM thinker decode engine (stage_configs/ci/qwen3_omni_tiny_hf_p_vllm_d.yaml;
docs/cross_engine_pd.md). The hf leg serves vLLM's MooncakeConnector consumer protocol
(kv/vllm/serve.py) and writes its blocks, translated into vLLM's CPU layout, into vLLM's cache.

- On held prompts (text and audio) the pipeline's greedy thinker tokens and audio bytes equal the
  vLLM-colocated and the hf-colocated pipelines' (which must agree); every prompt block moved,
  an exact count on the hf side, and vLLM loaded the whole prompt.
- Negative control: one staged block perturbed after its checked translation changes the output
  (vLLM's protocol carries no checksum to notice it); the next request is clean.
- A consumer whose ask is refused fails the handoff: counted toward the pair's breaker and
  answered by the fallback (the vLLM decode leg prefills the prompt itself), with equal output.
- Nothing is left held on any stage afterwards (every stage's /debug/state counts are zero).

- Delta, with vLLM's own prefix cache: the vLLM thinker runs with its prefix cache off (its
  prompt rows would be missing), so the delta is checked on the dense Qwen3 text model's pair
  (hf prefill -> vLLM decode, built from the text P/D configs): a second prompt sharing its
  first 2 blocks with the first finds them in vLLM's cache, so vLLM asks for fewer blocks and
  the hf side writes exactly the rest (vLLM's partial-prefix rule); its tokens equal hf
  colocated's. tests/test_hf_to_vllm_kv.py checks which blocks move.

One pipeline of each kind per module; the held prompts' colocated outputs are shared with
test_vllm_p_hf_d.py (cross_engine_refs.py). Needs vLLM (`OMNI_PD_VLLM=1 bash scripts/setup.sh`).
"""

from __future__ import annotations

import pytest
import yaml

from vllm_required import require_vllm

require_vllm()

from cross_engine_refs import (  # noqa: E402, F401 - fixtures
    BS,
    CI,
    assert_equals_both_colocated,
    hf_colocated,
    no_leaks,
    pipeline,
    run,
    vllm_colocated,
)
from omni_pd.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reverse():
    yield from pipeline("reverse", CI / "qwen3_omni_tiny_hf_p_vllm_d.yaml")


def _sent(omni) -> dict:
    return omni.control(0, "vllm_serve_stats")


@pytest.mark.parametrize("case", ["text", "audio"])
def test_the_reverse_pair_equals_both_colocated_pipelines(reverse, request, case):
    before = _sent(reverse)
    got = run(reverse, "hf_p_vllm_d", case)
    after = _sent(reverse)
    assert_equals_both_colocated(request, got, case)
    # Every prompt block went to vLLM over its own protocol, in one exchange; vLLM loaded the
    # whole prompt from it rather than computing it.
    prompt_len = len(got.prompt_token_ids)
    assert after["sends"] - before["sends"] == 1
    assert after["blocks_sent"] - before["blocks_sent"] == -(-prompt_len // BS)
    assert got.metrics["num_cached_prompt_tokens"] == prompt_len
    assert got.metrics["kv_fallback"] is False


def test_negative_control_a_perturbed_block_changes_the_output(reverse, hf_colocated):
    prompt = "Name three colours of the sea at dusk, and say why each one appears."
    want = hf_colocated.generate([prompt], use_tqdm=False)[0]
    reverse.control(0, "arm_fault", fault="vllm_serve_corruption", block_index=0, delta=0.5)
    corrupted = reverse.generate([prompt], use_tqdm=False)[0]
    assert corrupted.metrics["kv_fallback"] is False  # the perturbed KV was taken
    assert (corrupted.token_ids, corrupted.audio_sha256) != (want.token_ids, want.audio_sha256)
    clean = reverse.generate([prompt], use_tqdm=False)[0]  # the next one is clean
    assert (clean.token_ids, clean.audio_sha256) == (want.token_ids, want.audio_sha256)


def test_a_refused_consumer_counts_toward_the_breaker_and_falls_back(reverse, hf_colocated):
    prompt = "What does the wind do to the waves, and why?"
    want = hf_colocated.generate([prompt], use_tqdm=False)[0]
    failures, fallbacks = reverse.engine.handoff_failures, reverse.engine.fallbacks
    refusals = len(_sent(reverse)["refusals"])
    reverse.control(0, "arm_fault", fault="vllm_serve_refusal")
    got = reverse.generate([prompt], use_tqdm=False)[0]
    assert len(_sent(reverse)["refusals"]) == refusals + 1
    assert (reverse.engine.handoff_failures, reverse.engine.fallbacks) == (failures + 1, fallbacks + 1)
    assert got.metrics["kv_fallback"] is True
    assert (got.token_ids, got.audio_sha256) == (want.token_ids, want.audio_sha256)


@pytest.fixture(scope="module")
def text_reverse(tmp_path_factory):
    """The dense Qwen3 text model's hf prefill -> vLLM decode pair, vLLM's prefix cache on."""
    prefill = yaml.safe_load((CI / "qwen3_text_hf_pd.yaml").read_text())["stage_args"][0]
    data = yaml.safe_load((CI / "qwen3_text_pd_vllm.yaml").read_text())
    decode = data["stage_args"][1]
    prefill["engine_args"].update(kv_block_size=BS, prefix_caching_hash_algo="sha256_cbor")
    prefill["engine_args"]["kv_transfer_config"]["kv_connector_extra_config"]["serve_vllm_consumers"] = True
    decode["engine_args"].update(enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor")
    data["stage_args"] = [prefill, decode]
    path = tmp_path_factory.mktemp("text") / "qwen3_text_hf_p_vllm_d.yaml"
    path.write_text(yaml.safe_dump(data))
    yield from pipeline("text_reverse", path)


@pytest.fixture(scope="module")
def text_colocated():
    yield from pipeline("text_colocated", CI / "qwen3_text_hf.yaml")


def test_a_prompt_sharing_a_prefix_moves_only_the_blocks_vllm_lacks(text_reverse, text_colocated):
    first = [(11 * i + 7) % 200 + 20 for i in range(3 * BS + 5)]  # 3 full blocks and 5 tokens
    second = first[: 2 * BS] + [(5 * i + 3) % 200 + 20 for i in range(BS + 9)]  # shares 2 blocks
    greedy = [SamplingParams(temperature=0, max_tokens=8)]
    sent = _sent(text_reverse)["blocks_sent"]
    a = text_reverse.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)[0]
    assert _sent(text_reverse)["blocks_sent"] - sent == 4  # the control: every block of the first
    sent = _sent(text_reverse)["blocks_sent"]
    b = text_reverse.generate([{"prompt_token_ids": second}], greedy, use_tqdm=False)[0]
    # vLLM holds the shared 2 blocks (its own keys): it asks for the other 2, and only they move.
    assert _sent(text_reverse)["blocks_sent"] - sent == 2
    assert b.metrics["num_cached_prompt_tokens"] == len(second) - 2 * BS  # loaded over the connector
    for prompt, got in ((first, a), (second, b)):
        want = text_colocated.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
        assert got.token_ids == want.token_ids
