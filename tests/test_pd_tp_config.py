"""Mixed tensor parallelism on a P/D pair (issue 39, item 3), at config load: a vLLM pair may
differ in tensor_parallel_size when one size divides the other and each side's ranks hold whole
KV heads; anything else is refused naming the stage, the key and what to set. hf pairs keep
refusing a TP difference. No vLLM needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from omni_pd.config import ConfigError, load_pipeline_config
from omni_pd.paths import STAGE_CONFIGS_DIR

VLLM_PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_text_pd_vllm.yaml"  # tiny-qwen3-text: 2 KV heads
HF_PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_text_hf_pd.yaml"
OMNI_VLLM_PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_vllm_pd.yaml"  # the thinker: 1 KV head


def _write(tmp_path: Path, base: Path, prefill_tp: int, decode_tp: int, model: str | None = None) -> Path:
    data = yaml.safe_load(base.read_text())
    for stage, tp in zip(data["stage_args"], (prefill_tp, decode_tp)):
        stage["engine_args"]["tensor_parallel_size"] = tp
        if model is not None:
            stage["engine_args"]["model"] = model
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _issues(path: Path) -> list:
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    return list(info.value.issues)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_a_vllm_pair_whose_tp_sizes_divide_and_split_the_heads_loads(tmp_path, prefill_tp, decode_tp):
    cfg = load_pipeline_config(_write(tmp_path, VLLM_PD, prefill_tp, decode_tp))
    assert [s.engine_args.tensor_parallel_size for s in cfg.stages] == [prefill_tp, decode_tp]


def test_tp_sizes_neither_dividing_the_other_are_refused_on_the_decode_stage(tmp_path):
    issues = _issues(_write(tmp_path, VLLM_PD, 2, 3))
    on_decode = [i for i in issues if i.key == "stage_args[1].engine_args.tensor_parallel_size"]
    assert len(on_decode) == len(issues) == 2 and all(i.stage_id == 1 for i in on_decode), issues
    ranks, heads = on_decode
    assert "divides" in ranks.message and "prefill stage 0's 2" in ranks.allowed
    # 3 ranks do not split the tiny model's 2 KV heads either: said too.
    assert "2 KV heads do not split over 3 ranks" in heads.message


def test_kv_heads_that_do_not_split_are_refused_naming_the_stage_and_the_divisors(tmp_path):
    checkpoint = tmp_path / "ckpt"  # a checkpoint directory: its config.json says 6 KV heads
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_key_value_heads": 6}))
    issues = _issues(_write(tmp_path, VLLM_PD, 4, 2, model=str(checkpoint)))
    assert [i.key for i in issues] == ["stage_args[0].engine_args.tensor_parallel_size"], issues
    assert issues[0].stage_id == 0 and "6 KV heads do not split over 4 ranks" in issues[0].message
    assert "a divisor of 6 (1, 2, 3, 6)" in issues[0].allowed
    # the negative control: the same pair with sizes that split 6 heads loads
    load_pipeline_config(_write(tmp_path, VLLM_PD, 2, 1, model=str(checkpoint)))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)])
def test_more_ranks_than_kv_heads_replicate_the_heads_and_load(tmp_path, prefill_tp, decode_tp):
    """vLLM copies a KV head onto several ranks when there are more ranks than heads (and its
    MooncakeConnector sends one copy, or fills every copy): allowed, not taken for a bad split."""
    checkpoint = tmp_path / "ckpt"  # one KV head, as the tiny Qwen3-Omni thinker's
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_key_value_heads": 1}))
    cfg = load_pipeline_config(_write(tmp_path, VLLM_PD, prefill_tp, decode_tp, model=str(checkpoint)))
    assert [s.engine_args.tensor_parallel_size for s in cfg.stages] == [prefill_tp, decode_tp]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_the_omni_thinker_pair_loads_with_mixed_tp(tmp_path, prefill_tp, decode_tp):
    cfg = load_pipeline_config(_write(tmp_path, OMNI_VLLM_PD, prefill_tp, decode_tp))
    assert [s.engine_args.tensor_parallel_size for s in cfg.stages[:2]] == [prefill_tp, decode_tp]
    assert [s.engine_args.engine for s in cfg.stages[2:]] == ["hf", "hf"]  # talker, code2wav at TP 1


def test_hf_pairs_keep_refusing_a_tp_difference(tmp_path):
    issues = _issues(_write(tmp_path, HF_PD, 2, 1))
    issue = next(i for i in issues if i.key == "stage_args[1].engine_args.tensor_parallel_size")
    assert "identical layouts" in issue.message


def _unnamed(tmp_path: Path, prefill_tp: int, decode_tp: int) -> Path:
    """The text pair with no stage naming its model (as the shipped omni stage files)."""
    data = yaml.safe_load(_write(tmp_path, VLLM_PD, prefill_tp, decode_tp).read_text())
    for stage in data["stage_args"]:
        stage["engine_args"].pop("model", None)
    path = tmp_path / "unnamed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_pipelines_model_is_checked_at_start_when_no_stage_names_one(tmp_path):
    """Load cannot know the model (Omni(model=...)); the orchestrator checks the heads with it
    before any worker starts, by stage and key."""
    from omni_pd import Omni
    from omni_pd.config.model_tp import check_pair_tp_for_model

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_key_value_heads": 6}))
    path = _unnamed(tmp_path, 4, 2)
    config = load_pipeline_config(path)  # loads: no stage names a model
    with pytest.raises(ConfigError) as info:
        check_pair_tp_for_model(config, str(checkpoint), str(path))
    [issue] = info.value.issues
    assert issue.key == "stage_args[0].engine_args.tensor_parallel_size" and issue.stage_id == 0
    assert "6 KV heads do not split over 4 ranks" in issue.message
    with pytest.raises(ConfigError, match="6 KV heads do not split over 4 ranks"):
        Omni(model=str(checkpoint), stage_configs_path=path)  # refused before a worker starts
    # negative controls: sizes that split 6 heads, and the tiny omni thinker's one replicated head
    check_pair_tp_for_model(load_pipeline_config(_unnamed(tmp_path, 2, 1)), str(checkpoint), str(path))
    from omni_pd import registry

    assert registry.text_kv_heads("tiny-qwen3-omni") == 1  # read, so the check runs: TP 2 copies it
    omni_pd_config = load_pipeline_config(_write(tmp_path, OMNI_VLLM_PD, 2, 1))
    check_pair_tp_for_model(omni_pd_config, "tiny-qwen3-omni", "omni.yaml")
