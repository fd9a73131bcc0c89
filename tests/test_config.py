"""Stage YAML loading: vllm-omni compatibility and one clear issue per problem."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_pd.config import (
    ConfigError,
    ConfigIssue,
    PipelineConfig,
    StageConfig,
    load_pipeline_config,
)
from omni_pd.entrypoints.validate import run_validate
from omni_pd.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


# --- helpers ------------------------------------------------------------------------------------


def _stage(stage_id: int, model_stage: str, **extra: Any) -> dict[str, Any]:
    stage = {
        "stage_id": stage_id,
        "stage_type": "llm",
        "runtime": {"devices": "0", "max_batch_size": 1},
        "engine_args": {"engine": "hf", "model_stage": model_stage, "load_format": "dummy"},
        "default_sampling_params": {"temperature": 0.0, "max_tokens": 8},
    }
    stage.update(extra)
    return stage


def _kv(role: str, port: int) -> dict[str, Any]:
    return {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_bootstrap_port": port},
    }


def pd_config() -> dict[str, Any]:
    """A valid 4-stage P/D pipeline: 0 prefill -> 1 decode -> 2 talker -> 3 code2wav."""
    prefill = _stage(0, "thinker", is_prefill_only=True)
    prefill["engine_args"]["kv_transfer_config"] = _kv("kv_producer", 25201)
    decode = _stage(
        1,
        "thinker",
        is_decode_only=True,
        engine_input_source=[0],
        final_output=True,
        final_output_type="text",
    )
    decode["engine_args"]["kv_transfer_config"] = _kv("kv_consumer", 25202)
    talker = _stage(2, "talker", engine_input_source=[0, 1], custom_process_input_func="json.dumps")
    code2wav = _stage(
        3,
        "code2wav",
        engine_input_source=[2],
        custom_process_input_func="json.loads",
        final_output=True,
        final_output_type="audio",
    )
    return {
        "stage_args": [prefill, decode, talker, code2wav],
        "runtime": {
            "enabled": True,
            "defaults": {"window_size": -1, "max_inflight": 1},
            "edges": [{"from": 0, "to": 1}, {"from": 1, "to": 2}, {"from": 2, "to": 3}],
        },
    }


def write(tmp_path: Path, data: Any, name: str = "stages.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def errors_of(tmp_path: Path, data: Any, **kw: Any) -> list[ConfigIssue]:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path, **kw)
    assert all(issue.file == str(path) for issue in info.value.issues)
    return list(info.value.issues)


def only_issue(issues: list[ConfigIssue], key: str) -> ConfigIssue:
    matching = [i for i in issues if i.key == key]
    assert len(matching) == 1, f"expected one issue at {key}, got {[str(i) for i in issues]}"
    return matching[0]


# --- loading valid files ------------------------------------------------------------------------


def test_ci_config_loads_with_processor_imports() -> None:
    cfg = load_pipeline_config(REPO / "stage_configs/ci/qwen3_omni_tiny.yaml")
    assert cfg.stage_ids == (0, 1, 2)
    assert [s.model_stage for s in cfg.stages] == ["thinker", "talker", "code2wav"]
    assert all(s.engine == "hf" and s.engine_args.load_format == "dummy" for s in cfg.stages)
    assert cfg.edges() == ((0, 1), (1, 2))
    thinker = cfg.stage(0)
    assert thinker.default_sampling_params == SamplingParams(temperature=0.0, max_tokens=24, seed=42)
    assert thinker.engine_args.model is None  # the model comes from Omni(model=...) / --model
    assert cfg.stage(1).default_sampling_params.repetition_penalty == 1.05
    assert [s.stage_id for s in cfg.final_output_stages()] == [0, 2]


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "stage_configs").rglob("*.yaml")),
    ids=lambda p: str(p.relative_to(REPO / "stage_configs")),
)
def test_every_shipped_stage_config_loads(path: Path) -> None:
    assert load_pipeline_config(path).stages


def test_real_model_config_loads() -> None:
    cfg = load_pipeline_config(REPO / "stage_configs/qwen3_omni_moe.yaml", check_imports=False)
    assert [s.model_stage for s in cfg.stages] == ["thinker", "talker", "code2wav"]
    assert {s.engine_args.dtype for s in cfg.stages} == {"bfloat16"}
    assert cfg.stage(1).default_sampling_params.stop_token_ids == (2150,)


@pytest.mark.parametrize("name", ["qwen2_5_omni.yaml", "qwen2_5_omni_pd_separation.yaml"])
def test_qwen2_5_omni_real_model_configs_load(name: str) -> None:
    """The shipped Qwen2.5-Omni-7B files: bf16 hf stages, the talker stopping at the published
    codec end id (the real-shape config's), the thinker split where the name says so."""
    from omni_pd.models.qwen2_5_omni.real_config import CODEC_IDS

    cfg = load_pipeline_config(REPO / "stage_configs" / name, check_imports=False)
    stages = [s.model_stage for s in cfg.stages]
    assert stages == (["thinker"] * ("pd" in name) + ["thinker", "talker", "code2wav"])
    assert {s.engine_args.dtype for s in cfg.stages} == {"bfloat16"}
    talker = next(s for s in cfg.stages if s.model_stage == "talker")
    assert talker.default_sampling_params.stop_token_ids == (CODEC_IDS["tts_codec_end_token_id"],)
    assert cfg.stage(0).is_prefill_only == ("pd" in name)


def test_vllm_omni_style_pd_file_loads_with_its_processor_names_resolved() -> None:
    # Uses every key vllm-omni's Qwen3-Omni stage files use (P/D, connectors, async chunk).
    path = FIXTURES / "vllm_omni_style_pd.yaml"
    cfg = load_pipeline_config(path)
    assert cfg.stage(0).is_prefill_only and cfg.stage(1).is_decode_only
    assert cfg.stage(0).kv_transfer_config.bootstrap_port == 25201
    assert cfg.runtime.connectors["connector_of_mooncake"].name == "MooncakeStoreConnector"
    assert cfg.stage(3).engine_args.async_scheduling is False
    ours = "omni_pd.models.qwen3_omni.stage_input_processors"
    assert cfg.stage(2).custom_process_input_func == f"{ours}.thinker2talker"
    assert cfg.stage(3).custom_process_input_func == f"{ours}.talker2code2wav"


def test_next_stage_processor_goes_to_the_stages_it_feeds() -> None:
    """vllm-omni's async_chunk files name the processor on the producing stage."""
    from omni_pd.config.aliases import apply_processor_aliases

    vo = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"
    data = {
        "stage_args": [
            {
                "stage_id": 0,
                "engine_args": {"custom_process_next_stage_input_func": f"{vo}.thinker2talker_async_chunk"},
            },
            {"stage_id": 1, "engine_input_source": [0], "engine_args": {}},
            {
                "stage_id": 2,
                "engine_input_source": [0],
                "custom_process_input_func": "my.own.processor",
                "engine_args": {},
            },
        ]
    }
    out = apply_processor_aliases(data)
    assert (
        out["stage_args"][1]["custom_process_input_func"]
        == "omni_pd.models.qwen3_omni.stage_input_processors.thinker2talker"
    )
    assert out["stage_args"][2]["custom_process_input_func"] == "my.own.processor"  # its own wins
    assert "custom_process_input_func" not in data["stage_args"][1]  # the input is not changed


def test_an_unknown_vllm_omni_processor_is_still_an_import_error(tmp_path: Path) -> None:
    data = yaml.safe_load((FIXTURES / "vllm_omni_style_pd.yaml").read_text())
    data["stage_args"][2]["custom_process_input_func"] = (
        "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_v9"
    )
    issue = only_issue(errors_of(tmp_path, data), "stage_args[2].custom_process_input_func")
    assert "vllm_omni" in issue.message


def test_runtime_env_values_may_be_numbers() -> None:
    stage = StageConfig.model_validate(
        {
            "stage_id": 0,
            "runtime": {"env": {"OMP_NUM_THREADS": 4, "X": 0.5, "Y": True}},
            "engine_args": {"model_stage": "thinker"},
        }
    )
    assert stage.runtime.env == {"OMP_NUM_THREADS": "4", "X": "0.5", "Y": "true"}


def test_pd_config_loads(tmp_path: Path) -> None:
    cfg = load_pipeline_config(write(tmp_path, pd_config()))
    assert isinstance(cfg, PipelineConfig)
    assert cfg.edges() == ((0, 1), (0, 2), (1, 2), (2, 3))


def test_vllm_engine_kwargs_forward_only_set_vllm_keys() -> None:
    stage = StageConfig.model_validate(
        {
            "stage_id": 0,
            "engine_args": {
                "engine": "vllm",
                "model_stage": "thinker",
                "kv_block_size": 32,
                "max_num_seqs": 4,
                "tensor_parallel_size": 2,
                "hf_config_name": "thinker_config",
                "kv_transfer_config": {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
            },
        }
    )
    assert stage.engine_args.vllm_engine_kwargs() == {
        "max_num_seqs": 4,
        "tensor_parallel_size": 2,
        "kv_transfer_config": {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
    }


def test_stage_config_is_frozen() -> None:
    stage = StageConfig.model_validate({"stage_id": 0, "engine_args": {"model_stage": "thinker"}})
    with pytest.raises(Exception):
        stage.stage_id = 3  # type: ignore[misc]


# --- 1. unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "typo", "key", "suggestion", "stage_id"),
    [
        (
            ("stage_args", 1),
            "engine_input_sourc",
            "stage_args[1].engine_input_sourc",
            "engine_input_source",
            1,
        ),
        (
            ("stage_args", 0, "engine_args"),
            "gpu_memory_utilisation",
            "stage_args[0].engine_args.gpu_memory_utilisation",
            "gpu_memory_utilization",
            0,
        ),
        (
            ("stage_args", 1, "engine_args", "kv_transfer_config"),
            "kv_rol",
            "stage_args[1].engine_args.kv_transfer_config.kv_rol",
            "kv_role",
            1,
        ),
        (
            ("stage_args", 2, "runtime"),
            "max_batch_sise",
            "stage_args[2].runtime.max_batch_sise",
            "max_batch_size",
            2,
        ),
        (
            ("stage_args", 3, "default_sampling_params"),
            "max_token",
            "stage_args[3].default_sampling_params.max_token",
            "max_tokens",
            3,
        ),
        (("runtime", "edges", 0), "too", "runtime.edges[0].too", "to", None),
        (("runtime",), "edgse", "runtime.edgse", "edges", None),
        ((), "stage_arg", "stage_arg", "stage_args", None),
    ],
)
def test_unknown_key_is_named_with_suggestion(tmp_path: Path, where, typo, key, suggestion, stage_id) -> None:
    data = pd_config()
    node: Any = data
    for part in where:
        node = node[part]
    node[typo] = 1
    issue = only_issue(errors_of(tmp_path, data), key)
    assert issue.stage_id == stage_id
    assert f"unknown key '{typo}'" in issue.message
    assert f"did you mean '{suggestion}'" in issue.message


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][0]["engine_args"]["enforce_eagre"] = True
    data["stage_args"][2]["default_sampling_params"]["max_tokens"] = 0
    data["stage_args"][3]["engine_input_source"] = [9]
    data["async_chunks"] = False
    issues = errors_of(tmp_path, data)
    keys = {i.key for i in issues}
    assert {
        "stage_args[0].engine_args.enforce_eagre",
        "stage_args[2].default_sampling_params.max_tokens",
        "stage_args[3].engine_input_source",
        "async_chunks",
    } <= keys


def test_error_text_puts_each_issue_on_its_own_line(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][1]["engine_input_sourc"] = data["stage_args"][1].pop("engine_input_source")
    data["stage_args"][2]["engine_args"]["tensor_paralel_size"] = 2
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"2 problems in stage config {path}")
    assert any(
        str(path) in line
        and "stage 1" in line
        and "stage_args[1].engine_input_sourc" in line
        and "engine_input_source" in line
        for line in lines[1:]
    )
    assert any(
        str(path) in line and "stage 2" in line and "tensor_parallel_size" in line for line in lines[1:]
    )


# --- 2./3. ids and graph ------------------------------------------------------------------------


def test_hf_only_keys_on_a_vllm_stage_are_refused_by_name(tmp_path: Path) -> None:
    data = pd_config()
    thinker = data["stage_args"][0]["engine_args"]
    thinker.update(engine="vllm", kv_block_size=16, attention_kernels="torch")
    thinker.pop("load_format")
    errors = errors_of(tmp_path, data)
    issue = only_issue(errors, "stage_args[0].engine_args.kv_block_size")
    assert "only omni-pd's hf engine reads this key" in issue.message and "block_size" in str(issue)
    only_issue(errors, "stage_args[0].engine_args.attention_kernels")
    thinker.pop("kv_block_size"), thinker.pop("attention_kernels")
    data["stage_args"][1]["engine_args"]["engine"] = "vllm"  # the control: a clean vLLM pair loads
    data["stage_args"][1]["engine_args"].pop("load_format")
    load_pipeline_config(write(tmp_path, data))


def test_prefix_caching_hash_algo_on_an_hf_stage_is_vllms_and_checked_by_name(tmp_path: Path) -> None:
    from omni_pd.config.engine_keys import unused_by_hf
    from omni_pd.kv.vllm.block_hash import SUPPORTED_ALGOS

    data = pd_config()
    data["stage_args"][1]["engine_args"]["prefix_caching_hash_algo"] = "sha512"
    issue = only_issue(errors_of(tmp_path, data), "stage_args[1].engine_args.prefix_caching_hash_algo")
    assert "'sha512'" in str(issue) and all(f"'{a}'" in issue.message for a in SUPPORTED_ALGOS)
    for algo in SUPPORTED_ALGOS:  # the control: vLLM's own values load, and the hf engine reads them
        data["stage_args"][1]["engine_args"]["prefix_caching_hash_algo"] = algo
        stage = load_pipeline_config(write(tmp_path, data)).stage(1)
        assert stage.engine_args.prefix_caching_hash_algo == algo
        assert unused_by_hf(set(stage.engine_args.model_fields_set)) == []


def test_duplicate_stage_id(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][3]["stage_id"] = 2
    issue = only_issue(errors_of(tmp_path, data), "stage_args[3].stage_id")
    assert issue.stage_id == 2 and "duplicate" in issue.message and "stage_args[2]" in issue.message


def test_input_source_naming_missing_stage(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][3]["engine_input_source"] = [7]
    issue = only_issue(errors_of(tmp_path, data), "stage_args[3].engine_input_source")
    assert issue.stage_id == 3 and issue.got == 7 and "[0, 1, 2, 3]" in issue.allowed


def test_runtime_edge_naming_missing_stage(tmp_path: Path) -> None:
    data = pd_config()
    data["runtime"]["edges"].append({"from": 3, "to": 8})
    issue = only_issue(errors_of(tmp_path, data), "runtime.edges[3].to")
    assert issue.got == 8 and issue.stage_id is None


def test_cycle_is_reported_with_its_path(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][0]["engine_input_source"] = [3]
    issues = errors_of(tmp_path, data)
    cycles = [i for i in issues if "cycle" in i.message]
    assert len(cycles) == 1
    assert cycles[0].got in ("0 -> 1 -> 2 -> 3 -> 0", "0 -> 2 -> 3 -> 0")


def test_self_feeding_stage(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][2]["engine_input_source"] = [1, 2]
    issue = only_issue(errors_of(tmp_path, data), "stage_args[2].engine_input_source")
    assert "itself" in issue.message and issue.stage_id == 2


# --- 4. P/D pair --------------------------------------------------------------------------------


def _kvcfg(data: dict, index: int) -> dict:
    return data["stage_args"][index]["engine_args"]["kv_transfer_config"]


@pytest.mark.parametrize(
    ("mutate", "key", "stage_id", "needle"),
    [
        (
            lambda d: _kvcfg(d, 0).update(kv_role="kv_consumer"),
            "stage_args[0].engine_args.kv_transfer_config.kv_role",
            0,
            "kv_both or kv_producer",
        ),
        (
            lambda d: _kvcfg(d, 1).update(kv_role="kv_producer"),
            "stage_args[1].engine_args.kv_transfer_config.kv_role",
            1,
            "kv_both or kv_consumer",
        ),
        (
            lambda d: _kvcfg(d, 1).update(kv_connector="NixlConnector"),
            "stage_args[1].engine_args.kv_transfer_config.kv_connector",
            1,
            "MooncakeConnector",
        ),
        (
            lambda d: d["stage_args"][1]["engine_args"].pop("kv_transfer_config"),
            "stage_args[1].engine_args.kv_transfer_config",
            1,
            "kv_role",
        ),
        (
            lambda d: (_kvcfg(d, 0).update(engine_id="e"), _kvcfg(d, 1).update(engine_id="e")),
            "stage_args[1].engine_args.kv_transfer_config.engine_id",
            1,
            "different",
        ),
        (
            lambda d: _kvcfg(d, 1)["kv_connector_extra_config"].update(mooncake_bootstrap_port=25201),
            "stage_args[1].engine_args.kv_transfer_config.kv_connector_extra_config.mooncake_bootstrap_port",
            1,
            "different",
        ),
        (
            lambda d: [_kvcfg(d, i).update(kv_connector_extra_config={}, kv_port=14579) for i in (0, 1)],
            "stage_args[1].engine_args.kv_transfer_config.kv_port",
            1,
            "different",
        ),
        (
            lambda d: d["stage_args"][1]["engine_args"].update(tensor_parallel_size=2),
            "stage_args[1].engine_args.tensor_parallel_size",
            1,
            "1",
        ),
        (
            lambda d: d["stage_args"][1].update(engine_input_source=[]),
            "stage_args[1].engine_input_source",
            1,
            "containing 0",
        ),
        (
            lambda d: (
                _kvcfg(d, 0)["kv_connector_extra_config"].update(kv_same_host="off"),
                _kvcfg(d, 1)["kv_connector_extra_config"].update(kv_same_host="shm"),
            ),
            "stage_args[1].engine_args.kv_transfer_config.kv_connector_extra_config.kv_same_host",
            1,
            "not shared memory",
        ),
    ],
    ids=[
        "prefill-role",
        "decode-role",
        "connector",
        "missing-kv",
        "engine-id",
        "bootstrap-port",
        "kv-port",
        "tp",
        "not-fed",
        "same-host",
    ],
)
def test_pd_pair_problems(tmp_path: Path, mutate, key, stage_id, needle) -> None:
    data = pd_config()
    mutate(data)
    issue = only_issue(errors_of(tmp_path, data), key)
    assert issue.stage_id == stage_id
    assert needle in f"{issue.allowed} {issue.message}"


# --- 4a. replicas (runtime.num_replicas) ----------------------------------------------------------


def test_replicas_load_and_each_gets_its_own_devices_ports_and_engine_id(tmp_path: Path) -> None:
    from omni_pd.config.replicas import replica_configs

    data = pd_config()
    data["stage_args"][0]["runtime"].update(num_replicas=2, devices="0,1")
    _kvcfg(data, 0)["engine_id"] = "pre"
    data["stage_args"][1]["runtime"].update(num_replicas=3, devices="2,3,4")
    _kvcfg(data, 1)["kv_connector_extra_config"]["mooncake_bootstrap_port"] = 25210
    cfg = load_pipeline_config(write(tmp_path, data))
    prefill = replica_configs(cfg.stage(0))
    assert [r.runtime.devices for r in prefill] == ["0", "1"]
    assert [r.kv_transfer_config.engine_id for r in prefill] == ["pre-r0", "pre-r1"]
    assert [r.kv_transfer_config.bootstrap_port for r in prefill] == [25201, 25202]
    decode = replica_configs(cfg.stage(1))
    assert [r.kv_transfer_config.bootstrap_port for r in decode] == [25210, 25211, 25212]
    assert all(r.runtime.num_replicas == 3 for r in decode)
    assert replica_configs(cfg.stage(2)) == [cfg.stage(2)]  # one replica: the stage's own config


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (0, "greater than or equal to 1"),
        (-2, "greater than or equal to 1"),
        (True, "whole number"),
        ("two", "valid integer"),
    ],
)
def test_bad_num_replicas_is_named(tmp_path: Path, value: Any, needle: str) -> None:
    data = pd_config()
    data["stage_args"][2]["runtime"]["num_replicas"] = value
    issue = only_issue(errors_of(tmp_path, data), "stage_args[2].runtime.num_replicas")
    assert issue.stage_id == 2 and needle in issue.message


def test_replicas_the_devices_cannot_hold_are_refused(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][1]["runtime"].update(num_replicas=2, devices="0,1,2")
    data["stage_args"][1]["engine_args"]["engine"] = "vllm"
    data["stage_args"][1]["engine_args"]["tensor_parallel_size"] = 2
    issues = errors_of(tmp_path, data)
    issue = only_issue(issues, "stage_args[1].runtime.num_replicas")
    assert "need 4 devices" in issue.message and "at most 1" in issue.allowed


def test_replica_port_ranges_of_a_pair_must_not_meet(tmp_path: Path) -> None:
    data = pd_config()  # prefill on 25201, decode on 25202
    data["stage_args"][0]["runtime"].update(num_replicas=2, devices="0,1")  # 25201-25202: meets the decode's
    issue = only_issue(
        errors_of(tmp_path, data),
        "stage_args[1].engine_args.kv_transfer_config.kv_connector_extra_config.mooncake_bootstrap_port",
    )
    assert "replica index" in issue.allowed
    _kvcfg(data, 1)["kv_connector_extra_config"]["mooncake_bootstrap_port"] = 25203
    assert load_pipeline_config(write(tmp_path, data)).stage(0).runtime.num_replicas == 2


@pytest.mark.parametrize(
    ("edit", "key", "needle"),
    [
        (
            lambda st: st["engine_args"].update(distributed_executor_backend="uni"),
            "stage_args[2].engine_args.distributed_executor_backend",
            "local process or a Ray actor",
        ),
        (
            lambda st: (
                st["engine_args"].update(distributed_executor_backend="ray"),
                st["runtime"].update(process=False),
            ),
            "stage_args[2].runtime.process",
            "in-process stage cannot be one",
        ),
        (
            lambda st: st["runtime"].update(ray_resources={"decode_node": 1}),
            "stage_args[2].runtime.ray_resources",
            "runs as a local process",
        ),
    ],
)
def test_worker_backend_rules(tmp_path: Path, edit, key: str, needle: str) -> None:
    data = pd_config()
    edit(data["stage_args"][2])
    assert needle in only_issue(errors_of(tmp_path, data), key).message


def test_ray_stages_load_with_their_resources(tmp_path: Path) -> None:
    from omni_pd.orchestrator.ray_workers import actor_options

    data = pd_config()
    for stage in data["stage_args"]:
        stage["engine_args"]["distributed_executor_backend"] = "ray"
    data["stage_args"][0]["runtime"].update(ray_resources={"prefill_node": 1, "CPU": 2})
    cfg = load_pipeline_config(write(tmp_path, data))
    # CPU and GPU are Ray's own counts; one GPU per device unless GPU says otherwise.
    assert actor_options(cfg.stage(0)) == {
        "num_cpus": 2,
        "num_gpus": 1,
        "resources": {"prefill_node": 1},
        "max_restarts": 0,
    }
    assert actor_options(cfg.stage(1))["num_cpus"] == 0


# --- 4b. KV handoff fault keys (kv_connector_extra_config) ---------------------------------------

_EXTRA = "engine_args.kv_transfer_config.kv_connector_extra_config"


def _extra(data: dict, index: int) -> dict:
    return _kvcfg(data, index)["kv_connector_extra_config"]


def test_handoff_keys_have_defaults_and_load(tmp_path: Path) -> None:
    cfg = load_pipeline_config(write(tmp_path, pd_config()))
    extra = cfg.stage(1).kv_transfer_config.kv_connector_extra_config
    assert (
        extra.kv_miss_window_s,
        extra.kv_handoff_deadline_s,
        extra.kv_breaker_threshold,
        extra.kv_breaker_cooldown_s,
        extra.kv_fallback,
    ) == (5.0, 10.0, 3, 5.0, "local_prefill")
    data = pd_config()
    for index in (0, 1):  # the prefill stage may repeat the decode stage's values
        _extra(data, index).update(
            kv_miss_window_s=2,
            kv_handoff_deadline_s=4.5,
            kv_breaker_threshold=1,
            kv_breaker_cooldown_s=0.5,
            kv_fallback="error",
        )
    extra = load_pipeline_config(write(tmp_path, data)).stage(1).kv_transfer_config.kv_connector_extra_config
    assert (
        extra.kv_miss_window_s,
        extra.kv_handoff_deadline_s,
        extra.kv_breaker_threshold,
        extra.kv_breaker_cooldown_s,
        extra.kv_fallback,
    ) == (2.0, 4.5, 1, 0.5, "error")


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("kv_miss_window_s", 0, "greater than 0"),
        ("kv_miss_window_s", -1.5, "greater than 0"),
        ("kv_handoff_deadline_s", 0, "greater than 0"),
        ("kv_breaker_threshold", 0, "greater than or equal to 1"),
        ("kv_breaker_threshold", 2.5, "valid integer"),
        ("kv_breaker_threshold", True, "expected a number"),
        ("kv_breaker_cooldown_s", 0, "greater than 0"),
        ("kv_miss_window_s", "soon", "valid number"),
        ("kv_fallback", "retry", "'local_prefill' or 'error'"),
    ],
)
def test_bad_handoff_values(tmp_path: Path, key: str, value: Any, needle: str) -> None:
    data = pd_config()
    _extra(data, 1)[key] = value
    issue = only_issue(errors_of(tmp_path, data), f"stage_args[1].{_EXTRA}.{key}")
    assert issue.stage_id == 1 and issue.got == value and needle in issue.message


@pytest.mark.parametrize(
    ("extra", "key", "got"),
    [
        ({"kv_miss_window_s": 10.0}, "kv_miss_window_s", 10.0),  # equal to the default deadline
        ({"kv_miss_window_s": 6, "kv_handoff_deadline_s": 3}, "kv_miss_window_s", 6),
        ({"kv_handoff_deadline_s": 4}, "kv_handoff_deadline_s", 4),
    ],  # below the default window
    ids=["window-equals-deadline", "window-above-deadline", "deadline-below-default-window"],
)
def test_window_must_be_below_deadline(tmp_path: Path, extra, key, got) -> None:
    data = pd_config()
    _extra(data, 1).update(extra)
    issue = only_issue(errors_of(tmp_path, data), f"stage_args[1].{_EXTRA}.{key}")
    assert issue.got == got
    assert "kv_miss_window_s" in issue.message and "kv_handoff_deadline_s" in issue.message
    assert "lower kv_miss_window_s" in issue.message and "raise kv_handoff_deadline_s" in issue.message


@pytest.mark.parametrize(
    ("prefill", "decode", "key"),
    [
        ({"kv_miss_window_s": 2.0}, {}, "kv_miss_window_s"),  # the decode stage uses the default
        ({"kv_fallback": "error"}, {"kv_fallback": "local_prefill"}, "kv_fallback"),
        ({"kv_breaker_threshold": 5}, {"kv_breaker_threshold": 4}, "kv_breaker_threshold"),
    ],
)
def test_prefill_stage_may_not_contradict_the_decode_stages_handoff_keys(
    tmp_path: Path, prefill, decode, key
) -> None:
    data = pd_config()
    _extra(data, 0).update(prefill)
    _extra(data, 1).update(decode)
    issue = only_issue(errors_of(tmp_path, data), f"stage_args[0].{_EXTRA}.{key}")
    assert issue.stage_id == 0 and issue.got == prefill[key]
    assert key in issue.message and "prefill stage 0" in issue.message and "decode stage 1" in issue.message


def test_misspelt_handoff_key_is_not_passed_through_silently(tmp_path: Path) -> None:
    data = pd_config()
    _extra(data, 1)["kv_miss_windows_s"] = 2.0
    _extra(data, 1)["some_connector_key"] = 1  # a connector's own key still passes
    issue = only_issue(errors_of(tmp_path, data), f"stage_args[1].{_EXTRA}.kv_miss_windows_s")
    assert "did you mean 'kv_miss_window_s'" in issue.message


@pytest.mark.parametrize(("prefill", "decode"), [(16, 32), (32, 16), (16, 64), (8, 8)])
def test_kv_block_sizes_that_divide_one_another_load(tmp_path: Path, prefill: int, decode: int) -> None:
    data = pd_config()
    data["stage_args"][0]["engine_args"]["kv_block_size"] = prefill
    data["stage_args"][1]["engine_args"]["kv_block_size"] = decode
    cfg = load_pipeline_config(write(tmp_path, data))
    assert (cfg.stage(0).engine_args.kv_block_size, cfg.stage(1).engine_args.kv_block_size) == (
        prefill,
        decode,
    )


@pytest.mark.parametrize(("prefill", "decode"), [(16, 24), (32, 48), (12, 16)])
def test_kv_block_sizes_that_do_not_divide_are_refused_by_name(
    tmp_path: Path, prefill: int, decode: int
) -> None:
    data = pd_config()
    data["stage_args"][0]["engine_args"]["kv_block_size"] = prefill
    data["stage_args"][1]["engine_args"]["kv_block_size"] = decode
    issue = only_issue(errors_of(tmp_path, data), "stage_args[1].engine_args.kv_block_size")
    assert issue.stage_id == 1 and issue.got == decode
    assert f"prefill stage 0's kv_block_size {prefill}" in issue.allowed
    assert (
        "do not divide one another" in issue.message and "set either stage's kv_block_size" in issue.message
    )


def test_transfer_mode_defaults_to_pull_and_loads_push(tmp_path: Path) -> None:
    extra = load_pipeline_config(write(tmp_path, pd_config())).stage(1).kv_transfer_config
    assert extra.kv_connector_extra_config.transfer_mode == "pull"
    data = pd_config()
    for index in (0, 1):  # the prefill stage may repeat the decode stage's value
        _extra(data, index)["transfer_mode"] = "push"
    cfg = load_pipeline_config(write(tmp_path, data))
    assert cfg.stage(1).kv_transfer_config.kv_connector_extra_config.transfer_mode == "push"


@pytest.mark.parametrize(
    ("index", "value", "needle"), [(1, "stream", "'push' or 'pull'"), (0, "push", "governs")]
)
def test_bad_transfer_mode_is_refused_by_name(tmp_path: Path, index: int, value: str, needle: str) -> None:
    data = pd_config()
    _extra(data, index)["transfer_mode"] = value
    issue = only_issue(errors_of(tmp_path, data), f"stage_args[{index}].{_EXTRA}.transfer_mode")
    assert issue.stage_id == index and issue.got == value and needle in f"{issue.allowed} {issue.message}"


def test_push_on_a_vllm_pair_is_refused_by_name(tmp_path: Path) -> None:
    data = pd_config()
    for index in (0, 1):
        args = data["stage_args"][index]["engine_args"]
        args["engine"] = "vllm"
        _extra(data, index)["transfer_mode"] = "push"
    issues = errors_of(tmp_path, data)
    issue = only_issue(issues, f"stage_args[1].{_EXTRA}.transfer_mode")
    assert issue.got == "push" and "'pull'" in issue.allowed and "vLLM" in issue.message


def test_kv_both_is_fine_on_either_side(tmp_path: Path) -> None:
    data = pd_config()
    _kvcfg(data, 0)["kv_role"] = "kv_both"
    _kvcfg(data, 1)["kv_role"] = "kv_both"
    load_pipeline_config(write(tmp_path, data))


# --- 5. P/D shape -------------------------------------------------------------------------------


def test_two_prefill_stages(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][2]["is_prefill_only"] = True
    issue = only_issue(errors_of(tmp_path, data), "stage_args[2].is_prefill_only")
    assert issue.stage_id == 2 and "[0, 2]" in issue.message and "one prefill/decode pair" in issue.message


def test_stage_both_prefill_and_decode(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][0]["is_decode_only"] = True
    issues = errors_of(tmp_path, data)
    issue = only_issue(issues, "stage_args[0].is_decode_only")
    assert issue.stage_id == 0 and "both" in issue.message


@pytest.mark.parametrize(
    ("flag", "index", "needle"),
    [("is_decode_only", 1, "no decode-only"), ("is_prefill_only", 0, "no prefill-only")],
)
def test_half_a_pair(tmp_path: Path, flag: str, index: int, needle: str) -> None:
    data = pd_config()
    data["stage_args"][index][flag] = False  # remove one side of the pair
    other = 1 - index
    other_flag = "is_prefill_only" if flag == "is_decode_only" else "is_decode_only"
    issue = only_issue(errors_of(tmp_path, data), f"stage_args[{other}].{other_flag}")
    assert issue.stage_id == other and needle in issue.message


# --- 6. input processor imports -----------------------------------------------------------------


@pytest.fixture()
def broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "omnipd_broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(pkg))
    return "omnipd_broken_mod.func"


@pytest.mark.parametrize(
    ("func", "needle"),
    [
        ("no_such_pkg_omnipd.mod.func", "module 'no_such_pkg_omnipd' not found"),
        ("json.JSONDecodr", "has no attribute 'JSONDecodr'; did you mean 'JSONDecoder'?"),
        ("os.sep", "not callable"),
        ("broken", "RuntimeError: boom at import"),
    ],
)
def test_custom_process_input_func_must_import(
    tmp_path: Path, broken_module: str, func: str, needle: str
) -> None:
    data = pd_config()
    data["stage_args"][2]["custom_process_input_func"] = broken_module if func == "broken" else func
    issue = only_issue(errors_of(tmp_path, data), "stage_args[2].custom_process_input_func")
    assert issue.stage_id == 2 and needle in issue.message


def test_import_check_can_be_skipped(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][2]["custom_process_input_func"] = "no_such_pkg_omnipd.mod.func"
    load_pipeline_config(write(tmp_path, data), check_imports=False)


def test_custom_process_input_func_must_be_dotted(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][2]["custom_process_input_func"] = "thinker2talker"
    issue = only_issue(errors_of(tmp_path, data), "stage_args[2].custom_process_input_func")
    assert issue.got == "thinker2talker"


# --- 7. sampling params -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("max_tokens", 0, "max_tokens must be a positive integer"),
        ("max_tokens", -3, "positive"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("max_tokens", "lots", "valid integer"),
    ],
)
def test_bad_sampling_value(tmp_path: Path, field: str, value: Any, needle: str) -> None:
    data = pd_config()
    data["stage_args"][3]["default_sampling_params"][field] = value
    issue = only_issue(errors_of(tmp_path, data), f"stage_args[3].default_sampling_params.{field}")
    assert issue.stage_id == 3 and issue.got == value and needle in issue.message


def test_kv_transfer_params_not_allowed_in_yaml(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][1]["default_sampling_params"]["kv_transfer_params"] = {"do_remote_prefill": True}
    issue = only_issue(errors_of(tmp_path, data), "stage_args[1].default_sampling_params.kv_transfer_params")
    assert issue.stage_id == 1


# --- other schema rules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "key"),
    [
        (("engine_args", "engine"), "tgi", "stage_args[2].engine_args.engine"),
        (("engine_args", "model_stage"), "talkr", "stage_args[2].engine_args.model_stage"),
        (("engine_args", "engine_output_type"), "latents", "stage_args[2].engine_args.engine_output_type"),
        (("final_output_type",), "wav", "stage_args[2].final_output_type"),
        (("stage_type",), "dit", "stage_args[2].stage_type"),
        (("engine_args", "kv_block_size"), 0, "stage_args[2].engine_args.kv_block_size"),
    ],
)
def test_bad_enum_like_values(tmp_path: Path, path, value, key) -> None:
    data = pd_config()
    node = data["stage_args"][2]
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    issue = only_issue(errors_of(tmp_path, data), key)
    assert issue.stage_id == 2 and issue.got == value


def test_hf_model_stage_suggestion(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][2]["engine_args"]["model_stage"] = "talkr"
    issue = only_issue(errors_of(tmp_path, data), "stage_args[2].engine_args.model_stage")
    assert "did you mean 'talker'" in issue.message


def test_undeclared_connector(tmp_path: Path) -> None:
    data = pd_config()
    data["stage_args"][0]["output_connectors"] = {"to_stage_1": "mooncake"}
    issue = only_issue(errors_of(tmp_path, data), "stage_args[0].output_connectors.to_stage_1")
    assert "mooncake" in issue.message and issue.stage_id == 0


def test_top_level_typo_does_not_hide_declared_connectors(tmp_path: Path) -> None:
    data = yaml.safe_load((FIXTURES / "vllm_omni_style_pd.yaml").read_text())
    data["async_chunck"] = False
    issues = errors_of(tmp_path, data, check_imports=False)
    assert [i.key for i in issues] == ["async_chunck"]


def test_missing_engine_args(tmp_path: Path) -> None:
    data = pd_config()
    del data["stage_args"][3]["engine_args"]
    issue = only_issue(errors_of(tmp_path, data), "stage_args[3].engine_args")
    assert issue.stage_id == 3 and "missing" in issue.message


# --- file-level problems ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "file not found"),
        ("stage_args: [\n  - {a: 1\n", "not valid YAML at line"),
        ("- 1\n- 2\n", "not a mapping"),
        ("", "not a mapping"),
    ],
)
def test_unreadable_file_is_one_clear_error(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    assert len(info.value.issues) == 1
    assert needle in str(info.value) and str(path) in str(info.value)


def test_empty_stage_args(tmp_path: Path) -> None:
    issue = only_issue(errors_of(tmp_path, {"stage_args": []}), "stage_args")
    assert "missing or empty" in issue.message


# --- validate command ---------------------------------------------------------------------------


def test_run_validate_ok_prints_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_validate(str(write(tmp_path, pd_config()))) == 0
    out = capsys.readouterr().out
    assert "prefill stage 0 -> decode stage 1 via MooncakeConnector" in out
    assert "0 -> 1" in out and "[3] code2wav" in out


def test_run_validate_ci_config_has_no_pair(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_validate(str(REPO / "stage_configs/ci/qwen3_omni_tiny.yaml")) == 0
    assert "no prefill/decode pair" in capsys.readouterr().out


def test_run_validate_reports_every_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = copy.deepcopy(pd_config())
    data["stage_args"][0]["engine_args"]["kv_transfer_config"]["kv_role"] = "kv_consumer"
    data["stage_args"][3]["engine_input_sourc"] = [2]
    assert run_validate(str(write(tmp_path, data))) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "stage_args[0].engine_args.kv_transfer_config.kv_role" in captured.err
    assert "stage_args[3].engine_input_sourc" in captured.err


# --- the cross-engine pair (vLLM prefill -> hf decode) ------------------------------------------

MIXED_CONFIG = Path(__file__).resolve().parent.parent / "stage_configs/ci/qwen3_omni_tiny_vllm_p_hf_d.yaml"


def _mixed() -> dict[str, Any]:
    return yaml.safe_load(MIXED_CONFIG.read_text())


def test_a_vllm_prefill_stage_may_feed_an_hf_decode_stage() -> None:
    cfg = load_pipeline_config(MIXED_CONFIG)
    assert [s.engine for s in cfg.stages[:2]] == ["vllm", "hf"]


REVERSE_CONFIG = MIXED_CONFIG.with_name("qwen3_omni_tiny_hf_p_vllm_d.yaml")


def _reverse() -> dict[str, Any]:
    return yaml.safe_load(REVERSE_CONFIG.read_text())


def test_an_hf_prefill_stage_may_feed_a_vllm_decode_stage_that_it_serves() -> None:
    cfg = load_pipeline_config(REVERSE_CONFIG)
    assert [s.engine for s in cfg.stages[:2]] == ["hf", "vllm"]
    assert cfg.stages[0].kv_transfer_config.kv_connector_extra_config.serve_vllm_consumers is True


def test_an_hf_prefill_stage_feeding_vllm_must_serve_its_consumers(tmp_path: Path) -> None:
    data = _reverse()
    _kvcfg(data, 0)["kv_connector_extra_config"].pop("serve_vllm_consumers")
    key = "stage_args[0].engine_args.kv_transfer_config.kv_connector_extra_config.serve_vllm_consumers"
    issue = only_issue(errors_of(tmp_path, data), key)
    assert "set serve_vllm_consumers: true" in issue.message


def test_serve_vllm_consumers_is_refused_outside_the_reverse_pair(tmp_path: Path) -> None:
    data = _mixed()  # vLLM prefill -> hf decode: the hf side is a consumer
    _kvcfg(data, 1)["kv_connector_extra_config"]["serve_vllm_consumers"] = True
    key = "stage_args[1].engine_args.kv_transfer_config.kv_connector_extra_config.serve_vllm_consumers"
    issue = only_issue(errors_of(tmp_path, data), key)
    assert "this pair is vllm prefill -> hf decode" in issue.message


@pytest.mark.parametrize(
    "mutate, key, needles",
    [
        (
            lambda d: d["stage_args"][1]["engine_args"].update(block_size=64),
            "stage_args[1].engine_args.block_size",
            ("block_size 64", "kv_block_size 32"),
        ),
        (
            lambda d: d["stage_args"][0]["engine_args"].update(prefix_caching_hash_algo="xxhash"),
            "stage_args[0].engine_args.prefix_caching_hash_algo",
            ("'xxhash'", "'sha256_cbor'"),
        ),
        (
            lambda d: d["stage_args"][1]["engine_args"].pop("prefix_caching_hash_algo"),
            "stage_args[0].engine_args.prefix_caching_hash_algo",
            ("'sha256_cbor'", "'sha256'"),  # vLLM's default
        ),
        (
            lambda d: d["stage_args"][1]["engine_args"].update(tensor_parallel_size=2),
            "stage_args[1].engine_args.tensor_parallel_size",
            ("tensor_parallel_size differs from prefill stage 0's",),
        ),
    ],
    ids=["block-size", "hash-algo", "vllm-default-hash-algo", "tp"],
)
def test_the_reverse_pair_shares_block_size_and_block_keys_naming_both(
    tmp_path: Path, mutate, key, needles
) -> None:
    data = _reverse()
    mutate(data)
    issue = only_issue(errors_of(tmp_path, data), key)
    for needle in needles:
        assert needle in str(issue), str(issue)


@pytest.mark.parametrize(
    "mutate, key, needles",
    [
        (
            lambda d: d["stage_args"][1]["engine_args"].update(kv_block_size=64),
            "stage_args[1].engine_args.kv_block_size",
            ("kv_block_size 64", "block_size 32"),
        ),
        (
            lambda d: d["stage_args"][1]["engine_args"].update(prefix_caching_hash_algo="xxhash"),
            "stage_args[1].engine_args.prefix_caching_hash_algo",
            ("'sha256_cbor'",),
        ),
        (
            lambda d: d["stage_args"][0]["engine_args"].pop("prefix_caching_hash_algo"),
            "stage_args[1].engine_args.prefix_caching_hash_algo",
            ("'sha256'",),  # vLLM's default
        ),
        (
            # the hf decode leg reads one vLLM rank's whole cache: the prefill's TP is what to change
            lambda d: d["stage_args"][0]["engine_args"].update(tensor_parallel_size=2),
            "stage_args[0].engine_args.tensor_parallel_size",
            ("1 (as hf decode stage 1)", "does not reshard KV heads"),
        ),
    ],
    ids=["block-size", "hash-algo", "vllm-default-hash-algo", "vllm-prefill-tp"],
)
def test_a_cross_engine_pair_shares_block_size_and_block_keys(tmp_path: Path, mutate, key, needles) -> None:
    data = _mixed()
    mutate(data)
    issue = only_issue(errors_of(tmp_path, data), key)
    for needle in needles:
        assert needle in str(issue), str(issue)


def test_a_step_budget_smaller_than_a_block_or_the_seats_is_refused_by_name(tmp_path: Path) -> None:
    data = pd_config()
    thinker = data["stage_args"][0]["engine_args"]
    thinker.update(max_num_batched_tokens=8, kv_block_size=16)
    issue = only_issue(errors_of(tmp_path, data), "stage_args[0].engine_args.max_num_batched_tokens")
    assert "stage 0" in str(issue) and "at least kv_block_size (16)" in str(issue)
    thinker.update(enable_chunked_prefill=False)  # whole prompts: no chunk to fill a block
    load_pipeline_config(write(tmp_path, data))
    thinker.update(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=64)
    issue = only_issue(errors_of(tmp_path, data), "stage_args[0].engine_args.max_num_batched_tokens")
    assert "max_num_seqs (64)" in str(issue)
    thinker.update(max_num_seqs=32)  # the control
    load_pipeline_config(write(tmp_path, data))
