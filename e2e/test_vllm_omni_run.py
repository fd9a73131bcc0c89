"""vllm-omni's own deploy file runs (issue 12, criterion 5): vllm-omni 0.30's
deploy/qwen3_omni_moe.yaml (written for GPUs 0 and 1) with the tiny model on the CPU
(`device="cpu"`) gives the same tokens and audio as omni-pd's own tiny config, for the same
sampling parameters."""

import zipfile
from pathlib import Path

import pytest
import torch

from omni_pd.models.qwen3_omni.factory import save_tiny_model
from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

from vllm_omni_wheels import vllm_omni_wheel

pytestmark = pytest.mark.slow
PROMPTS = ["Tell me about the sea.", "Hi"]


def _params(talker_seed: int = 42) -> list:
    # Stated for every stage, so both files run with the same ones (the deploy file's own
    # defaults ask for 2048 thinker tokens and 4096 codec frames).
    return [
        SamplingParams(temperature=0.0, max_tokens=24, seed=42),
        SamplingParams(temperature=0.9, top_k=50, max_tokens=64, seed=talker_seed, repetition_penalty=1.05),
        None,
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # The deploy file loads real weights (load_format auto): the tiny model's, seed 42, as the
    # dummy weights of omni-pd's tiny configs.
    return save_tiny_model(tmp_path_factory.mktemp("tiny_ckpt"), seed=42)


@pytest.fixture(scope="module")
def deploy_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm_omni_deploy") / "qwen3_omni_moe.yaml"
    with zipfile.ZipFile(vllm_omni_wheel("0.30.0")) as wheel:
        path.write_bytes(wheel.read("vllm_omni/deploy/qwen3_omni_moe.yaml"))
    return path


def test_vllm_omni_deploy_file_runs_the_tiny_model_like_omni_pd_config(checkpoint, deploy_file):
    with Omni(model=str(checkpoint), deploy_config=deploy_file, device="cpu") as omni:
        assert omni.config.async_chunk and len(omni.config.stages) == 3
        theirs = omni.generate(PROMPTS, _params(), use_tqdm=False)
        other_seed = omni.generate(PROMPTS[:1], _params(talker_seed=7), use_tqdm=False)[0]
    with Omni(stage_configs_path=STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml") as omni:
        ours = omni.generate(PROMPTS, _params(), use_tqdm=False)
    for a, b in zip(theirs, ours):
        assert a.token_ids == b.token_ids
        assert a.audio is not None and torch.equal(a.audio, b.audio)
    # Negative control: the comparison sees a different talker seed.
    assert other_seed.token_ids == ours[0].token_ids
    assert not torch.equal(other_seed.audio, ours[0].audio)


def test_vllm_omni_style_pd_file_runs_the_tiny_model_like_colocated(checkpoint):
    """tests/fixtures/vllm_omni_style_pd.yaml has every key of vllm-omni's legacy P/D files
    (GPU devices, vllm_omni processor names, its connectors); vllm-omni's own P/D CI file is in
    its repository only, out of reach of CI. Run on the CPU, its P/D handoff gives the colocated
    tokens and audio."""
    fixture = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_omni_style_pd.yaml"
    with Omni(model=str(checkpoint), stage_configs_path=fixture, device="cpu") as omni:
        pd = omni.generate(PROMPTS, _params(), use_tqdm=False)
        other_seed = omni.generate(PROMPTS[:1], _params(talker_seed=7), use_tqdm=False)[0]
    with Omni(stage_configs_path=STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml") as omni:
        colocated = omni.generate(PROMPTS, _params(), use_tqdm=False)
    assert not torch.equal(other_seed.audio, colocated[0].audio)  # the comparison can fail
    for a, b in zip(pd, colocated):
        assert a.metrics["num_cached_prompt_tokens"] == len(a.prompt_token_ids)  # handed off
        assert not a.metrics["kv_fallback"]
        assert a.token_ids == b.token_ids and torch.equal(a.audio, b.audio)
