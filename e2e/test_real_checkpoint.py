"""A real-layout checkpoint: the medium random model (1.1 GB of float32) written by
`omni-pd make-tiny-model --size medium`, sharded and whole, gives bit-identical tokens and audio
through the P/D pipeline, and each stage's load stays within its memory target."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_pd.models.checkpoint import INDEX_FILE, SINGLE_FILE, read_shard_index
from omni_pd.models.qwen3_omni.factory import load_stage, save_tiny_model, weights_fingerprint
from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = pytest.mark.slow
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
SHARD_BYTES = 200 * 10**6


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "omni_pd.entrypoints.cli", *args], capture_output=True, text=True
    )


@pytest.fixture(scope="session")
def medium(tmp_path_factory):
    """The medium checkpoint, built once per session: sharded (through the CLI) and whole."""
    root = tmp_path_factory.mktemp("medium")
    done = _cli(
        "make-tiny-model",
        str(root / "sharded"),
        "--size",
        "medium",
        "--seed",
        "42",
        "--max-shard-size",
        "200MB",
    )
    assert done.returncode == 0, done.stderr
    save_tiny_model(root / "whole", seed=42, size="medium")
    return {"sharded": root / "sharded", "whole": root / "whole"}


def test_medium_checkpoint_has_hf_sharded_layout(medium):
    sharded = medium["sharded"]
    index = read_shard_index(sharded)
    assert index.source.name == INDEX_FILE and len(index.shards) >= 5
    sizes = [(sharded / s).stat().st_size for s in index.shards]
    data = [size - _header_bytes(sharded / s) for size, s in zip(sizes, index.shards)]
    assert all(d <= SHARD_BYTES for d in data) and sum(data) >= 2**30  # max_shard_size: tensor bytes
    assert all(
        s.startswith("model-") and s.endswith(f"-of-{len(sizes):05d}.safetensors") for s in index.shards
    )
    assert {"config.json", "tokenizer.json"} <= {p.name for p in sharded.iterdir()}
    assert (medium["whole"] / SINGLE_FILE).is_file() and not (medium["whole"] / INDEX_FILE).exists()
    total = json.loads((sharded / INDEX_FILE).read_text())["metadata"]["total_size"]
    assert total == sum(data)


def _header_bytes(path):
    with open(path, "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def test_perturbed_shard_changes_the_part_fingerprint(medium, tmp_path):
    sharded, whole = medium["sharded"], medium["whole"]
    a, _ = load_stage(str(sharded), "code2wav")
    b, _ = load_stage(str(whole), "code2wav")
    assert weights_fingerprint(a.code2wav) == weights_fingerprint(b.code2wav)
    # Negative control: one value one step off in the sharded copy is noticed.
    copy = tmp_path / "copy"
    copy.mkdir()
    name = "code2wav.code_embedding.weight"
    shard = read_shard_index(sharded).weight_map[name]
    for f in (INDEX_FILE, "config.json"):
        shutil.copy(sharded / f, copy / f)
    tensors = load_file(str(sharded / shard))
    flat = tensors[name].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(1.0))
    save_file(tensors, str(copy / shard), metadata={"format": "pt"})
    c, _ = load_stage(str(copy), "code2wav")  # the other shards are absent: never opened
    assert weights_fingerprint(c.code2wav) != weights_fingerprint(b.code2wav)


def _outputs(model_dir, config):
    prompts = [{"messages": [{"role": "user", "content": text}]} for text in ("Hi", "Tell me about the sea.")]
    with Omni(model=str(model_dir), stage_configs_path=config) as omni:
        return [(r.token_ids, r.audio) for r in omni.generate(prompts, use_tqdm=False)]


def test_whole_and_sharded_give_identical_pd_outputs(medium, tmp_path):
    config = tmp_path / "pd_files.yaml"
    text = PD.read_text()
    assert "load_format: dummy" in text
    config.write_text(text.replace("load_format: dummy", "load_format: auto"))
    sharded = _outputs(medium["sharded"], config)
    whole = _outputs(medium["whole"], config)
    for (tokens_a, audio_a), (tokens_b, audio_b) in zip(sharded, whole):
        assert tokens_a == tokens_b and len(tokens_a) > 1
        assert audio_a is not None and torch.equal(audio_a, audio_b)
    # Random weights: a talker may end at once (no audio); one prompt must speak.
    assert max(audio.numel() for _, audio in sharded) > 0
    # The two prompts differ in output, or equal outputs would prove little.
    assert sharded[0][0] != sharded[1][0]


def test_bench_load_meets_the_memory_target(medium, tmp_path):
    out = tmp_path / "load.json"
    done = _cli("bench", "load", str(medium["sharded"]), "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["stage"]: r for r in json.loads(out.read_text())["results"]}
    assert rows.keys() == {"thinker", "talker", "code2wav"}
    assert rows["thinker"]["part_bytes"] > rows["talker"]["part_bytes"] > rows["code2wav"]["part_bytes"]
    for row in rows.values():
        assert row["within_target"], row
        assert row["rss_growth"] <= 1.3 * row["part_bytes"] + 64 * 2**20
        assert row["shards_read"] < row["shards_total"]
