"""Qwen2.5-Omni's lean stage loading: each stage reads only its part of a sharded checkpoint, equal
bit for bit (weights and recomputed buffers) to the seeded build the checkpoint was written from;
a broken checkpoint is one CheckpointError naming the tensor."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_pd.models.checkpoint import CheckpointError, read_shard_index
from omni_pd.models.qwen2_5_omni.factory import build_dummy_model, load_stage, save_tiny_model
from omni_pd.models.qwen2_5_omni.stage_parts import PARTS, THINKER_EMBEDDING
from omni_pd.models.qwen2_5_omni.tiny_config import DEFAULT_SEED, tiny_config_dict
from transformers import Qwen2_5OmniConfig

ATTR = {"thinker": "thinker", "talker": "talker", "code2wav": "token2wav"}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("q25") / "sharded", max_shard_size="300KB")


@pytest.fixture(scope="module")
def whole():
    return build_dummy_model(Qwen2_5OmniConfig(**tiny_config_dict()), DEFAULT_SEED)


def _tensors(module):
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _same(a, b) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta
    )


@pytest.mark.parametrize("stage", PARTS)
def test_a_stage_loads_its_part_alone_equal_to_the_seeded_build(sharded, whole, stage):
    parts, reports = load_stage(str(sharded), stage)
    module = parts.require(ATTR[stage])
    assert _same(module, getattr(whole, ATTR[stage]))  # buffers too: recomputed, not read
    assert [p for p in ATTR.values() if getattr(parts, p) is not None] == [ATTR[stage]]
    if stage == "talker":
        assert torch.equal(parts.thinker_embedding.weight, whole.thinker.get_input_embeddings().weight)
    if stage == "code2wav":
        assert all(t.dtype == torch.float32 for t in module.parameters())
    index = read_shard_index(sharded)
    prefix = f"{ATTR[stage]}."
    mine = {shard for name, shard in index.weight_map.items() if name.startswith(prefix)}
    assert len(index.shards) > len(mine)  # the checkpoint has other shards it never opens
    assert set(reports[0].shards_read) == mine


def test_negative_control_a_changed_tensor_is_seen(sharded, whole, tmp_path):
    copy = shutil.copytree(sharded, tmp_path / "copy")
    index = read_shard_index(copy)
    name = "talker.codec_head.weight"
    shard = copy / index.weight_map[name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, shard, metadata={"format": "pt"})
    parts, _ = load_stage(str(copy), "talker")
    assert not _same(parts.talker, whole.talker)


def test_a_missing_tensor_of_the_part_is_named(sharded, tmp_path):
    copy = shutil.copytree(sharded, tmp_path / "copy")
    index = read_shard_index(copy)
    shard = copy / index.weight_map[THINKER_EMBEDDING]
    tensors = load_file(shard)
    del tensors[THINKER_EMBEDDING]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="thinker.model.embed_tokens.weight"):
        load_stage(str(copy), "talker")
