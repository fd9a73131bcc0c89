"""The `omni-pd` console script as a user runs it, in a subprocess."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from omni_pd.entrypoints.cli import _printable
from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "omni_pd.entrypoints.cli", "--log-level", "WARNING"]
TINY = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
TINY_PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
DEPLOY_PD = STAGE_CONFIGS_DIR / "deploy" / "qwen3_omni_tiny_pd.yaml"


def _run(*args, check=True):
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=check, env=env, timeout=300)


def _generate_json(tmp_path, *extra):
    out = _run(
        "generate",
        "--prompt",
        "Tell me about the sea.",
        "--json",
        "--output",
        str(tmp_path / "out.wav"),
        *extra,
    )
    return json.loads(out.stdout)  # exactly one JSON object, nothing else on stdout


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """One `generate --json` of the colocated config, which several tests compare against (each
    run starts a whole pipeline: CI time)."""
    return _generate_json(tmp_path_factory.mktemp("colocated"), "--stage-configs-path", str(TINY))


@pytest.fixture(scope="module")
def default_pd(tmp_path_factory):
    """One `generate --json` of the default config (P/D, TINY_PD), with a timeline."""
    out = tmp_path_factory.mktemp("default_pd")
    return _generate_json(out, "--timeline", str(out / "timeline.png")), out / "timeline.png"


def test_generate_json_reports_text_audio_and_timings(default_pd):
    # The default config: P/D across processes, streaming between stages.
    result, timeline_png = default_pd
    for key in ("text", "token_ids", "audio_path", "sample_rate", "num_samples", "audio_sha256", "metrics"):
        assert key in result
    assert result["sample_rate"] == 24_000 and result["num_samples"] > 0
    samples, rate = soundfile.read(result["audio_path"], dtype="float32")
    assert rate == 24_000 and len(samples) == result["num_samples"]
    assert hashlib.sha256(samples.tobytes()).hexdigest() == result["audio_sha256"]
    metrics = result["metrics"]
    assert 0 < metrics["ttft_ms"] <= metrics["e2e_ms"]
    assert set(metrics["stage_ms"]) == {"0", "1", "2", "3"}
    # Tiny thinker: 4 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes per prompt token.
    assert metrics["kv_bytes_transferred"] == len(result["prompt_token_ids"]) * 4 * 2 * 2 * 16 * 4
    assert metrics["kv_transfer_ms"] > 0
    # The request's timeline: every stage's span, and the audio chunks (drawn into the PNG).
    timeline = metrics["timeline"]
    names = {k: v["name"] for k, v in timeline["stages"].items()}
    assert names == {"0": "thinker prefill", "1": "thinker decode", "2": "talker", "3": "code2wav"}
    for span in timeline["stages"].values():
        assert 0 <= span["start_ms"] <= span["end_ms"] <= metrics["e2e_ms"]
    assert timeline["stages"]["2"]["start_ms"] < timeline["stages"]["1"]["end_ms"]  # overlapped
    assert len(timeline["audio_chunks_ms"]) > 1
    assert metrics["ttfa_ms"] == timeline["audio_chunks_ms"][0] < metrics["e2e_ms"]
    assert timeline_png.read_bytes()[:4] == b"\x89PNG"


def test_colocated_config_reports_no_kv_transfer(colocated):
    metrics = colocated["metrics"]
    assert set(metrics["stage_ms"]) == {"0", "1", "2"} and "kv_bytes_transferred" not in metrics


def test_deploy_config_generates_what_its_stage_args_twin_does(tmp_path, default_pd):
    # vllm-omni 0.30's deploy schema: the same P/D pipeline as the stage_args file, so the same
    # tokens and audio, byte for byte.
    deploy = _generate_json(tmp_path, "--deploy-config", str(DEPLOY_PD))
    legacy = default_pd[0]
    assert legacy["metrics"]["stage_ms"].keys() == {"0", "1", "2", "3"}  # the default is TINY_PD
    assert len(deploy["token_ids"]) > 0 and deploy["num_samples"] > 0
    assert deploy["token_ids"] == legacy["token_ids"]
    assert deploy["audio_sha256"] == legacy["audio_sha256"]
    assert deploy["metrics"]["kv_bytes_transferred"] == legacy["metrics"]["kv_bytes_transferred"] > 0
    # Negative control: the deploy file's own values are what runs; another talker seed in it
    # (its sampling defaults) gives other audio from the same text.
    text = DEPLOY_PD.read_text()
    talker_seed = "      seed: 42\n      repetition_penalty: 1.05"
    assert text.count(talker_seed) == 1
    reseeded = tmp_path / "reseeded.yaml"
    reseeded.write_text(text.replace(talker_seed, "      seed: 7\n      repetition_penalty: 1.05"))
    other = _generate_json(tmp_path, "--deploy-config", str(reseeded))
    assert other["token_ids"] == legacy["token_ids"] and other["audio_sha256"] != legacy["audio_sha256"]


def test_generate_plain_prints_text_and_timings(tmp_path):
    out = _run("generate", "--prompt", "hi", "--output", str(tmp_path / "a.wav"))
    assert out.stdout.startswith("text: ") and "timings: ttft" in out.stdout
    assert (tmp_path / "a.wav").is_file()


def test_generate_stream_prints_text_and_writes_the_same_wav(tmp_path, colocated):
    streamed = _run(
        "generate",
        "--prompt",
        "Tell me about the sea.",
        "--stream",
        "--stage-configs-path",
        str(TINY),
        "--output",
        str(tmp_path / "s.wav"),
    )
    plain = colocated
    printed, _, rest = streamed.stdout.partition("\ntokens: ")
    assert printed == "text: " + _printable(plain["text"]) and "timings: ttft" in rest
    got, rate = soundfile.read(tmp_path / "s.wav", dtype="float32")
    want, want_rate = soundfile.read(plain["audio_path"], dtype="float32")
    assert soundfile.info(tmp_path / "s.wav").subtype == soundfile.info(plain["audio_path"]).subtype
    assert rate == want_rate == 24_000 and len(want) > 0 and np.array_equal(got, want)
    assert hashlib.sha256(got.tobytes()).hexdigest() == plain["audio_sha256"]
    # Negative control: one sample one step off is noticed.
    got[len(got) // 2] = np.nextafter(got[len(got) // 2], np.float32(1))
    assert not np.array_equal(got, want)


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """The embedded tiny model written as a checkpoint in several shards (one make-tiny-model
    run for the tests below: CI time)."""
    ckpt = tmp_path_factory.mktemp("checkpoint") / "sharded"
    _run("make-tiny-model", str(ckpt), "--seed", "42", "--max-shard-size", "200KB")
    assert len(list(ckpt.glob("model-*.safetensors"))) > 1
    return ckpt


def test_checkpoint_directory_gives_the_same_output_as_dummy_weights(tmp_path, colocated, sharded_checkpoint):
    ckpt = sharded_checkpoint
    # The same stage config, but loading the written safetensors instead of seeded weights.
    config = tmp_path / "from_files.yaml"
    config.write_text(TINY.read_text().replace("load_format: dummy", "load_format: auto"))
    dummy = colocated
    files = _generate_json(tmp_path, "--model", str(ckpt), "--stage-configs-path", str(config))
    assert files["token_ids"] == dummy["token_ids"]
    assert files["audio_sha256"] == dummy["audio_sha256"]


def test_validate_config_exit_codes(tmp_path):
    ok = _run("validate-config", str(TINY))
    assert "thinker" in ok.stdout
    deploy = _run("validate-config", "--deploy-config", str(DEPLOY_PD))
    assert "pipeline qwen3_omni_moe_pd" in deploy.stdout and "P/D: prefill stage 0" in deploy.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("engine_input_source: [0]", "engine_input_sourc: [0]"))
    result = _run("validate-config", str(bad), check=False)
    assert result.returncode == 2
    assert "engine_input_sourc" in result.stderr and "engine_input_source" in result.stderr


def test_unknown_model_is_one_clear_error(tmp_path):
    result = _run("generate", "--prompt", "hi", "--model", str(tmp_path / "nope"), check=False)
    assert result.returncode == 1
    assert "neither the embedded" in result.stderr and "Traceback" not in result.stderr


def test_broken_checkpoint_is_one_start_up_error(tmp_path, sharded_checkpoint):
    ckpt = tmp_path / "sharded"
    shutil.copytree(sharded_checkpoint, ckpt)
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.unlink()
    config = tmp_path / "from_files.yaml"
    config.write_text(TINY.read_text().replace("load_format: dummy", "load_format: auto"))
    result = _run(
        "generate",
        "--prompt",
        "hi",
        "--model",
        str(ckpt),
        "--stage-configs-path",
        str(config),
        "--output",
        str(tmp_path / "o.wav"),
        check=False,
    )
    assert result.returncode == 1
    assert "failed to start: CheckpointError" in result.stderr and shard.name in result.stderr
    assert "Traceback" not in result.stderr
