"""The real model's shapes in CI, as a quick smoke (issue 38): a checkpoint with every dimension
of Qwen3-Omni-30B-A3B-Instruct and one layer per stack, written by `make-tiny-model --size real`,
loads lean and answers one short request through thinker, talker and code2wav, P/D equal to
colocated. The measurements belong to `omni-pd bench roofline`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from omni_pd.models.checkpoint import INDEX_FILE
from omni_pd.models.qwen3_omni import real_checkpoint
from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.slow
CI = STAGE_CONFIGS_DIR / "ci"


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "omni_pd.entrypoints.cli", *args], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    directory = tmp_path_factory.mktemp("real") / "qwen3-omni-real-1"
    done = _cli("make-tiny-model", str(directory), "--size", "real", "--layers", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "writing needs" in done.stdout and "each stage loads its part" in done.stdout  # the estimate first
    return directory


def test_the_checkpoint_has_the_published_dimensions(real):
    config = json.loads((real / "config.json").read_text())
    text = config["thinker_config"]["text_config"]
    assert (
        text["hidden_size"],
        text["num_attention_heads"],
        text["num_key_value_heads"],
        text["head_dim"],
    ) == (2048, 32, 4, 128)
    assert (
        text["num_experts"],
        text["num_experts_per_tok"],
        text["moe_intermediate_size"],
        text["vocab_size"],
    ) == (128, 8, 768, 152064)
    assert text["num_hidden_layers"] == 1 and config["code2wav_config"]["decoder_dim"] == 1536
    index = json.loads((real / INDEX_FILE).read_text())["weight_map"]
    # Sharded as the published checkpoint: experts one tensor each, bf16.
    assert "thinker.model.layers.0.mlp.experts.127.down_proj.weight" in index
    assert len(set(index.values())) >= 3


def _config(tmp_path, name: str) -> str:
    text = (CI / name).read_text().replace("load_format: dummy", "load_format: auto")
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _answer(real, config):
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0.9, top_k=50, seed=1, max_tokens=4, ignore_eos=True),
        None,
    ]
    with Omni(model=str(real), stage_configs_path=config) as omni:
        out = omni.generate(["Hi"], params, use_tqdm=False)[0]
        assert all(v == 0 for v in omni.debug_state_counts().values())
    return out


def test_one_short_request_p_d_equal_to_colocated(real, tmp_path):
    colocated = _answer(real, _config(tmp_path, "qwen3_omni_tiny.yaml"))
    pd = _answer(real, _config(tmp_path, "qwen3_omni_tiny_pd.yaml"))
    assert len(colocated.token_ids) == 3 and colocated.audio is not None and colocated.audio.numel() > 0
    assert pd.token_ids == colocated.token_ids
    assert torch.equal(pd.audio, colocated.audio)


def test_too_many_layers_or_too_little_memory_is_refused_with_numbers(tmp_path, monkeypatch, capsys):
    from omni_pd.entrypoints import cli

    for layers, said in (("49", "--layers must be a whole number from 1 to 48"), ("0", "not 0")):
        assert cli.main(["make-tiny-model", str(tmp_path / "x"), "--size", "real", "--layers", layers]) == 2
        assert said in capsys.readouterr().err
    # A host with less memory than the write needs (1 GiB available; one layer needs ~7.6).
    monkeypatch.setattr(real_checkpoint, "available_memory", lambda: 2**30)
    with pytest.raises(MemoryError, match=r"needs \d+\.\d+ GiB of memory and this host has 1\.00 GiB"):
        real_checkpoint.save_real_model(tmp_path / "x", 1, log=lambda _: None)
    assert not (tmp_path / "x").exists()
