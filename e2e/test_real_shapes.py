"""The real models' shapes in CI, as a quick smoke (issue 38, and issue 49 for the second model):
a checkpoint with every dimension of Qwen3-Omni-30B-A3B-Instruct, or of Qwen2.5-Omni-7B, and one
layer per stack, written by `make-tiny-model --size real`, loads lean and answers one short
request through thinker, talker and code2wav (token2wav), P/D equal to colocated. The
measurements belong to `omni-pd bench roofline`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from omni_pd.models.checkpoint import INDEX_FILE
from omni_pd.models.qwen2_5_omni import real_checkpoint as q25_checkpoint
from omni_pd.models.qwen3_omni import real_checkpoint
from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.slow
CI = STAGE_CONFIGS_DIR / "ci"
# model -> the CI stage files it runs under (colocated, P/D)
CONFIGS = {
    "qwen3_omni": ("qwen3_omni_tiny.yaml", "qwen3_omni_tiny_pd.yaml"),
    "qwen2_5_omni": ("qwen2_5_omni_tiny.yaml", "qwen2_5_omni_tiny_pd.yaml"),
}


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "omni_pd.entrypoints.cli", *args], capture_output=True, text=True
    )


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def real(request, tmp_path_factory):
    """(model, checkpoint directory), one model at a time (each checkpoint is ~3 GiB)."""
    directory = tmp_path_factory.mktemp("real") / f"{request.param}-real-1"
    done = _cli(
        "make-tiny-model", str(directory), "--model", request.param, "--size", "real", "--layers", "1"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "writing needs" in done.stdout and "each stage loads its part" in done.stdout  # the estimate first
    yield request.param, directory
    for path in directory.iterdir():
        path.unlink()


def _published(model: str, config: dict) -> None:
    if model == "qwen3_omni":
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
        return
    text = config["thinker_config"]["text_config"]
    assert (text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]) == (3584, 28, 4)
    assert (text["intermediate_size"], text["vocab_size"], text["num_hidden_layers"]) == (18944, 152064, 1)
    talker = config["talker_config"]
    assert (talker["hidden_size"], talker["num_attention_heads"], talker["head_dim"]) == (896, 12, 128)
    assert (talker["vocab_size"], talker["embedding_size"]) == (8448, 3584)
    token2wav = config["token2wav_config"]
    assert token2wav["dit_config"]["hidden_size"] == 1024
    assert token2wav["bigvgan_config"]["upsample_initial_channel"] == 1536


def test_the_checkpoint_has_the_published_dimensions(real):
    model, directory = real
    _published(model, json.loads((directory / "config.json").read_text()))
    index = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) >= 3  # sharded, a part per shard at least
    if model == "qwen3_omni":
        # Sharded as the published checkpoint: experts one tensor each, bf16.
        assert "thinker.model.layers.0.mlp.experts.127.down_proj.weight" in index
    else:
        assert "token2wav.code2wav_dit_model.transformer_blocks.0.attn.to_q.weight" in index
        voices = torch.load(directory / "spk_dict.pt", weights_only=True)
        assert {tuple(v["cond"].shape) for v in voices.values()} == {(1, 192)}
        assert {tuple(v["ref_mel"].shape) for v in voices.values()} == {(1, 400, 80)}


def _config(tmp_path, name: str) -> str:
    text = (CI / name).read_text().replace("load_format: dummy", "load_format: auto")
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# The models whose decode-leg outputs show the KV at one layer a stack. Qwen2.5-Omni's decode leg
# returns its last layer's rows, which attend to the KV. Qwen3-Omni's returns layer 0's rows (its
# talker reads the middle layer: 1 // 2 = 0), which attend to nothing, and its tokens: a flipped
# KV byte (measured) left the three tokens and the audio as they were. So this smoke checks
# Qwen3-Omni's P/D only against colocated, and the flipped-byte control of the tiny model's suite
# (e2e/test_pd_equivalence.py) stands for it.
KV_VISIBLE = ("qwen2_5_omni",)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=3),
    SamplingParams(temperature=0.9, top_k=50, seed=1, max_tokens=4, ignore_eos=True),
    None,
]


def _clean(omni) -> bool:
    return all(v == 0 for v in omni.debug_state_counts().values())


def _tensor_fields_differing(a, b) -> list[str]:
    """The tensor fields of two stage outputs (dataclasses) whose bytes differ."""
    return [
        f.name
        for f in dataclasses.fields(a)
        if isinstance(getattr(a, f.name), torch.Tensor)
        and not torch.equal(getattr(a, f.name), getattr(b, f.name))
    ]


def test_one_short_request_p_d_equal_to_colocated(real, tmp_path):
    model, directory = real
    colocated_yaml, pd_yaml = CONFIGS[model]
    with Omni(model=str(directory), stage_configs_path=_config(tmp_path, colocated_yaml)) as omni:
        colocated = omni.generate(["Hi"], PARAMS, use_tqdm=False)[0]
        assert _clean(omni)
    pd_config = _config(tmp_path, pd_yaml)
    with Omni(model=str(directory), stage_configs_path=pd_config, keep_stage_outputs=True) as omni:
        pd = omni.generate(["Hi"], PARAMS, use_tqdm=False)[0]
        decode = next(s.stage_id for s in omni.config.stages if s.is_decode_only)
        if model in KV_VISIBLE:
            # Negative control: one flipped byte of the KV that the decode leg reads is seen.
            omni.control(0, "arm_fault", fault="kv_corruption", block_index=0, byte_offset=3)
            corrupted = omni.generate(["Hi"], PARAMS, use_tqdm=False)[0]
            assert _tensor_fields_differing(pd.stage_outputs[decode], corrupted.stage_outputs[decode])
        assert _clean(omni)
    assert len(colocated.token_ids) == 3 and colocated.audio is not None and colocated.audio.numel() > 0
    assert pd.token_ids == colocated.token_ids
    assert torch.equal(pd.audio, colocated.audio)


@pytest.mark.parametrize(
    "module, deepest",
    [(real_checkpoint, 48), (q25_checkpoint, 32)],
    ids=["qwen3_omni", "qwen2_5_omni"],
)
def test_too_many_layers_or_too_little_memory_is_refused_with_numbers(
    module, deepest, tmp_path, monkeypatch, capsys
):
    from omni_pd.entrypoints import cli

    model = "qwen3_omni" if module is real_checkpoint else "qwen2_5_omni"
    for layers, said in (
        (str(deepest + 1), f"--layers must be a whole number from 1 to {deepest}"),
        ("0", "not 0"),
    ):
        argv = [
            "make-tiny-model",
            str(tmp_path / "x"),
            "--model",
            model,
            "--size",
            "real",
            "--layers",
            layers,
        ]
        assert cli.main(argv) == 2
        assert said in capsys.readouterr().err
    # A host with less memory than the write needs (1 GiB available; one layer needs several).
    monkeypatch.setattr(module, "available_memory", lambda: 2**30)
    with pytest.raises(MemoryError, match=r"needs \d+\.\d+ GiB of memory and this host has 1\.00 GiB"):
        module.save_real_model(tmp_path / "x", 1, log=lambda _: None)
    assert not (tmp_path / "x").exists()


def test_a_model_without_a_real_shape_config_is_refused_by_name(tmp_path, capsys):
    from omni_pd.entrypoints import cli

    argv = [
        "make-tiny-model",
        str(tmp_path / "x"),
        "--model",
        "qwen3_text",
        "--size",
        "real",
        "--layers",
        "1",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "'qwen3_text' has no real-shape checkpoint" in err and "qwen2_5_omni" in err


def test_qwen2_5_omni_at_full_depth_counts_the_published_parameters():
    """All 32 layers asked for (each stack keeps its published depth): the parts count the
    10.7 B parameters Qwen/Qwen2.5-Omni-7B's model card states (built on the meta device)."""
    work = q25_checkpoint.plan(32)
    assert work.layers == {"thinker": 28, "audio_encoder": 32, "vision_encoder": 32, "talker": 24, "dit": 22}
    assert round(sum(p.parameters for p in work.parts) / 1e8) == 107
