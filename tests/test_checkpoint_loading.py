"""Lean stage loading from safetensors checkpoints: each stage reads only its part, equal to the
seeded (dummy) build, and every broken checkpoint is one CheckpointError naming file and tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_pd.models.checkpoint import INDEX_FILE, CheckpointError, read_shard_index
from omni_pd.models.qwen3_omni.factory import load_stage, save_tiny_model, weights_fingerprint
from omni_pd.models.qwen3_omni.stage_parts import PARTS, THINKER_EMBEDDING

SEED = 42  # the tiny_model fixture's


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny model (seed 42) in HF's sharded layout, ~16 shards of at most 200 kB."""
    return save_tiny_model(tmp_path_factory.mktemp("ckpt") / "sharded", seed=SEED, max_shard_size="200KB")


@pytest.fixture
def copy(sharded, tmp_path):
    return shutil.copytree(sharded, tmp_path / "copy")


def _shards_of(directory, prefix):
    weight_map = read_shard_index(directory).weight_map
    return sorted({shard for name, shard in weight_map.items() if name.startswith(prefix)})


def _buffers(module):
    return {name: b for name, b in module.named_buffers()}


@pytest.mark.parametrize("stage", PARTS)
def test_stage_loads_its_part_equal_to_the_dummy_build(sharded, tiny_model, stage):
    parts, reports = load_stage(str(sharded), stage)
    module = getattr(parts, stage)
    assert weights_fingerprint(module) == weights_fingerprint(getattr(tiny_model, stage))
    # Non-persistent buffers (rotary inv_freq, code offsets, position tables) are not in the
    # fingerprint: recomputed from meta, they must equal the whole build's.
    want = _buffers(getattr(tiny_model, stage))
    got = _buffers(module)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(not t.is_meta and t.data_ptr() % 64 == 0 for t in module.state_dict().values())
    # Nothing of the other parts.
    assert [p for p in PARTS if getattr(parts, p) is not None] == [stage]
    assert (parts.thinker_embedding is not None) == (stage == "talker")
    if stage == "talker":
        assert torch.equal(parts.thinker_embedding.weight, tiny_model.thinker.get_input_embeddings().weight)
    shards = read_shard_index(sharded).shards
    assert set(reports[0].shards_read) == set(_shards_of(sharded, f"{stage}.")) < set(shards)


def test_the_lean_thinker_gives_the_whole_models_logits(sharded, tiny_model):
    parts, _ = load_stage(str(sharded), "thinker")
    ids = torch.tensor([[260, 257, 10, 72, 105, 261, 10, 260, 258, 10]])
    with torch.no_grad():
        assert torch.equal(parts.thinker(input_ids=ids).logits, tiny_model.thinker(input_ids=ids).logits)


def test_a_stage_never_opens_the_other_parts_shards(copy):
    # Delete every shard the code2wav stage does not need: it still loads.
    keep = set(_shards_of(copy, "code2wav."))
    for shard in read_shard_index(copy).shards:
        if shard not in keep:
            (copy / shard).unlink()
    parts, _ = load_stage(str(copy), "code2wav")
    assert parts.code2wav is not None
    with pytest.raises(CheckpointError, match="is missing"):
        load_stage(str(copy), "thinker")


def test_single_file_checkpoint_loads_the_same(tmp_path, sharded):
    single = save_tiny_model(tmp_path / "single", seed=SEED)
    assert not (single / INDEX_FILE).exists()
    for stage in PARTS:
        a, _ = load_stage(str(single), stage)
        b, _ = load_stage(str(sharded), stage)
        assert weights_fingerprint(getattr(a, stage)) == weights_fingerprint(getattr(b, stage))


def _rewrite_shard(directory, name, change):
    """Apply `change(tensors)` to the shard holding tensor `name`; returns the shard's path."""
    path = directory / read_shard_index(directory).weight_map[name]
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_negative_control_a_perturbed_tensor_changes_the_fingerprint(copy, tiny_model):
    name = "thinker.model.layers.0.self_attn.q_proj.weight"
    _rewrite_shard(copy, name, lambda t: t[name].view(-1)[0].add_(1e-3))
    parts, _ = load_stage(str(copy), "thinker")
    assert weights_fingerprint(parts.thinker) != weights_fingerprint(tiny_model.thinker)


def test_missing_shard_names_the_file_and_a_tensor(copy):
    shard = _shards_of(copy, "talker.")[0]
    (copy / shard).unlink()
    with pytest.raises(CheckpointError) as info:
        load_stage(str(copy), "talker")
    assert shard in str(info.value) and "missing" in str(info.value) and "talker." in str(info.value)


@pytest.mark.parametrize(
    "text, expected", [("{not json", "is not valid JSON"), ('{"metadata": {}}', "has no `weight_map`")]
)
def test_corrupt_index_is_named(copy, text, expected):
    (copy / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=expected) as info:
        load_stage(str(copy), "thinker")
    assert INDEX_FILE in str(info.value)


def test_truncated_shard_is_named(copy):
    path = copy / _shards_of(copy, "thinker.")[0]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_stage(str(copy), "thinker")
    assert path.name in str(info.value)


def test_a_dtype_the_stage_cannot_use_is_named(copy):
    name = "code2wav.code_embedding.weight"
    path = _rewrite_shard(copy, name, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(CheckpointError) as info:
        load_stage(str(copy), "code2wav")
    message = str(info.value)
    assert name in message and path.name in message and "I8" in message and "float" in message


def test_a_missing_tensor_of_the_part_is_named(copy):
    name = "talker.codec_head.weight"
    _rewrite_shard(copy, name, lambda t: t.pop(name))
    index = json.loads((copy / INDEX_FILE).read_text())
    del index["weight_map"][name]
    (copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lacks 1 tensor") as info:
        load_stage(str(copy), "talker")
    assert name in str(info.value) and INDEX_FILE in str(info.value)
    # ...and the index promising a tensor its shard lacks is named too.
    index["weight_map"][name] = index["weight_map"][THINKER_EMBEDDING]
    (copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lacks {name}"):
        load_stage(str(copy), "talker")


def test_a_directory_without_safetensors_is_named(tmp_path, sharded):
    shutil.copy(sharded / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_stage(str(tmp_path), "thinker")


def test_stage_parts_move_to_a_device_together(sharded):
    # What a GPU stage does after loading (here to `meta`, which any machine has).
    parts, _ = load_stage(str(sharded), "talker")
    assert parts.to("meta") is parts
    assert all(t.is_meta for t in (*parts.talker.parameters(), *parts.thinker_embedding.parameters()))
