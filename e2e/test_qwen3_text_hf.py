"""A second architecture through the same engine core (issue 37): the dense Qwen3 text model on
omni-pd's hf engines, colocated and P/D. Its runner (omni_pd/models/qwen3_text/hf/text_runner.py) is all it
adds: the generic engine, scheduler, KV manager and P/D legs are the Qwen3-Omni thinker's."""

from __future__ import annotations

import pytest
import torch

from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.exactness]
COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_text_hf.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_text_hf_pd.yaml"
PROMPTS = [
    "Hi",
    "Tell me about the sea.",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Count to five.",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7),
]


@pytest.fixture(scope="module")
def colocated():
    with Omni(stage_configs_path=COLOCATED) as omni:
        yield omni


@pytest.fixture(scope="module")
def pd():
    with Omni(stage_configs_path=PD) as omni:
        yield omni


def _clean(omni) -> bool:
    return all(v == 0 for v in omni.debug_state_counts().values())


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_pd_equals_colocated_alone_and_all_at_once(colocated, pd, params):
    want = [colocated.generate([p], [params])[0] for p in PROMPTS]
    assert len({tuple(o.token_ids) for o in want}) == len(PROMPTS)  # the prompts really differ
    alone = [pd.generate([p], [params])[0] for p in PROMPTS]
    together = pd.generate(PROMPTS, [params])
    for w, a, t in zip(want, alone, together):
        assert a.token_ids == w.token_ids and t.token_ids == w.token_ids
        assert a.text == w.text
        # The decode engine computed no prompt position: its KV came over from the prefill (or,
        # for a prompt sent before, from the blocks it holds already).
        assert a.metrics["num_cached_prompt_tokens"] == len(a.prompt_token_ids)
        assert a.metrics["kv_bytes_transferred"] + a.metrics.get("kv_bytes_reused", 0) > 0
    assert _clean(colocated) and _clean(pd)


def test_negative_control_a_flipped_kv_byte_changes_the_answer(colocated, pd):
    prompt, params = PROMPTS[1], PARAMS[0]
    want = colocated.generate([prompt], [params])[0]
    # The exponent byte of the first K value of layer 0, before the checksums are taken, so the
    # corruption travels undetected: the decode engine attends to a huge key.
    pd.control(0, "arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
    assert pd.generate([prompt], [params])[0].token_ids != want.token_ids
    assert pd.generate([prompt], [params])[0].token_ids == want.token_ids  # the next one is clean


def test_the_runner_computes_transformers_qwen3(colocated):
    """Teacher-forced on the same weights: the engine's greedy tokens are transformers' own
    `generate` (the logits are close, not bit for bit: other kernels)."""
    from transformers import Qwen3ForCausalLM

    from omni_pd.models.qwen3_text.tiny_config import ensure_tiny_text_model

    llm = Qwen3ForCausalLM.from_pretrained(ensure_tiny_text_model(0)).eval()
    for prompt in PROMPTS[:2]:
        out = colocated.generate([prompt], [PARAMS[0]])[0]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            theirs = llm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(out.token_ids),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert theirs[0, ids.shape[1] :].tolist() == out.token_ids


def test_audio_prompts_are_refused_up_front(colocated):
    import numpy as np

    tone = (0.2 * np.sin(np.arange(8000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
    with pytest.raises(Exception, match="audio|multimodal|token ids"):
        colocated.generate([[{"role": "user", "content": [{"type": "audio", "audio": tone}]}]])
    assert _clean(colocated)
