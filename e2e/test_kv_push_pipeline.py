"""Push mode end to end: the tiny P/D pipeline with transfer_mode push (the decode stage paging
its KV in blocks of 32, the prefill stage in blocks of 16, prompts prefilled in 32-token chunks
whose blocks are written while the next chunk computes) equals the colocated pipeline byte for
byte: thinker tokens, merged talker inputs, codec codes, audio. A negative control flips one
pushed byte and shows the comparison notices; a repeated prompt moves only the blocks the decode
side does not hold yet; nothing is left behind on any stage."""

import pytest
import yaml

from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR

from test_pd_equivalence import _per_token_kv_bytes, _prompts, differences

# Not `exactness`: the second-ISA pass covers chunked prefill over cached KV (the compute push
# relies on) in test_prefix_caching; what is new here is the transport, which no ISA changes.
pytestmark = [pytest.mark.slow]
COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
CASES = ["short", "over_one_block", "long_1000", "audio"]


def push_config(tmp_path_factory):
    data = yaml.safe_load(PD.read_text())
    prefill, decode = data["stage_args"][0]["engine_args"], data["stage_args"][1]["engine_args"]
    prefill["kv_transfer_config"]["kv_connector_extra_config"].update(kv_push_chunk_tokens=32)
    decode["kv_block_size"] = 32
    decode["kv_transfer_config"]["kv_connector_extra_config"].update(transfer_mode="push")
    path = tmp_path_factory.mktemp("push") / "push.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def colocated():
    with Omni(stage_configs_path=COLOCATED, keep_stage_outputs=True) as omni:
        yield omni


@pytest.fixture(scope="module")
def push(tmp_path_factory):
    with Omni(stage_configs_path=push_config(tmp_path_factory), keep_stage_outputs=True) as omni:
        yield omni


def assert_nothing_left(omni):
    counts = omni.debug_state_counts()
    assert all(v == 0 for v in counts.values()), counts


def test_push_equals_colocated_and_a_flipped_byte_is_noticed(colocated, push):
    prompts = _prompts(colocated)
    for case in CASES:
        want = colocated.generate([prompts[case]])[0]
        got = push.generate([prompts[case]])[0]
        assert got.metrics["kv_path"] == "push", (case, got.metrics)
        assert not got.metrics["kv_fallback"]
        assert differences(colocated, want, push, got) == [], case
        n = len(got.prompt_token_ids)
        assert got.metrics["kv_bytes_transferred"] == n * _per_token_kv_bytes(push)
    # Negative control: a byte flipped in the first pushed block before its checksum.
    prompt = prompts["over_one_block"]
    want = colocated.generate([prompt])[0]
    push.control(0, "arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
    corrupted = push.generate([prompt])[0]
    assert "talker input hidden states" in differences(colocated, want, push, corrupted)
    assert differences(colocated, want, push, push.generate([prompt])[0]) == []
    assert_nothing_left(push)


def test_a_repeated_prompt_pushes_only_the_blocks_the_decode_side_lacks(colocated, push):
    prompt = "Otters hold hands while they sleep on the water. " * 6
    first = push.generate([prompt])[0]
    again = push.generate([prompt])[0]
    want = colocated.generate([prompt])[0]
    n, per_token = len(again.prompt_token_ids), _per_token_kv_bytes(push)
    reused = again.metrics["kv_reused_tokens"]
    assert reused == (n // 32) * 32 and reused > first.metrics["kv_reused_tokens"]
    assert again.metrics["kv_bytes_transferred"] == (n - reused) * per_token
    assert differences(colocated, want, push, again) == []
    assert_nothing_left(push)
