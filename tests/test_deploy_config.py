"""vllm-omni 0.30's deploy schema (`--deploy-config`) loads onto omni-pd's built-in Qwen3-Omni
pipelines (issue 12, criteria 2 and 3).

vllm-omni's own deploy files are read from its published 0.30.0 wheel (fetched once with
`pip download --no-deps` into .cache/, never copied into the repository).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_omni_wheels import vllm_omni_wheel

from omni_pd.config import ConfigError, PipelineConfig, load_pipeline_config
from omni_pd.config.deploy import load_deploy, load_deploy_config
from omni_pd.config.engine_keys import HF_ENGINE_KEYS
from omni_pd.entrypoints.cli import main as cli_main
from omni_pd.entrypoints.validate import run_validate
from omni_pd.orchestrator.async_omni import AsyncOmni
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

DEPLOY_VERSION = "0.30.0"
DEPLOY_FILES = (
    "qwen3_omni_moe.yaml",
    "qwen3_omni_moe_thinking.yaml",
    "qwen3_omni_duplex.yaml",
    "qwen3_omni_moe_mori_intranode.yaml",
)
SHIPPED = STAGE_CONFIGS_DIR / "deploy"
CI = STAGE_CONFIGS_DIR / "ci"


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    """vllm-omni 0.30.0's Qwen3-Omni deploy files, under their own names (base_config is relative)."""
    out = tmp_path_factory.mktemp("vllm_omni_deploy")
    with zipfile.ZipFile(vllm_omni_wheel(DEPLOY_VERSION)) as wheel:
        for name in DEPLOY_FILES:
            (out / name).write_bytes(wheel.read(f"vllm_omni/deploy/{name}"))
    return out


def _raw(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _issues(path: Path, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_deploy_config(path, check_imports=False, **kwargs)
    return [str(issue) for issue in exc.value.issues]


def _one_issue(path: Path, *needles: str, **kwargs) -> str:
    issues = _issues(path, **kwargs)
    assert len(issues) == 1, "\n".join(issues)
    for needle in needles:
        assert needle in issues[0], issues[0]
    return issues[0]


def _file_stage(raw: dict[str, Any], stage_id: int) -> dict[str, Any]:
    return next(s for s in raw["stages"] if s["stage_id"] == stage_id)


# --- vllm-omni 0.30.0's own files -----------------------------------------------------------


def test_qwen3_omni_moe_loads_onto_the_builtin_pipeline(wheel_dir):
    path = wheel_dir / "qwen3_omni_moe.yaml"
    loaded = load_deploy(path, platform="cpu")
    cfg = loaded.config
    assert loaded.pipeline == "qwen3_omni_moe" and loaded.platform == "cpu"
    assert [s.model_stage for s in cfg.stages] == ["thinker", "talker", "code2wav"]
    assert [list(s.engine_input_source) for s in cfg.stages] == [[], [0], [1]]
    assert [s.final_output_type for s in cfg.stages] == ["text", None, "audio"]
    assert cfg.async_chunk is True
    thinker, talker, code2wav = cfg.stages
    # code2wav's chunking comes from the `extra` of the connector that feeds it.
    assert (
        code2wav.engine_args.initial_codec_chunk_frames,
        code2wav.engine_args.codec_chunk_frames,
        code2wav.engine_args.codec_left_context_frames,
    ) == (4, 25, 25)
    # Flat per-stage keys are engine arguments; devices is the runtime's.
    assert (
        thinker.engine_args.max_num_seqs,
        thinker.engine_args.max_num_batched_tokens,
        thinker.engine_args.gpu_memory_utilization,
        thinker.engine_args.moe_backend,
    ) == (64, 32768, 0.9, "triton")
    assert thinker.engine_args.trust_remote_code is True
    assert code2wav.engine_args.max_num_batched_tokens == 65536
    assert code2wav.engine_args.enable_chunked_prefill is False
    assert [s.runtime.devices for s in cfg.stages] == ["0", "1", "1"]
    # Connectors are declarations, wired as written.
    assert cfg.runtime.connectors["connector_of_shared_memory"].name == "SharedMemoryConnector"
    assert talker.input_connectors == {"from_stage_0": "connector_of_shared_memory"}
    # The file's sampling defaults are the stage's, as vllm-omni uses them (not merged with
    # omni-pd's fallback defaults; vllm-omni's detokenize / codec-stop constraints are not
    # needed: omni-pd's talker stops at the checkpoint's codec_eos_token_id).
    raw = _raw(path)
    for stage in cfg.stages:
        assert stage.default_sampling_params == SamplingParams(
            **_file_stage(raw, stage.stage_id)["default_sampling_params"]
        )
    assert thinker.default_sampling_params.repetition_penalty == 1.0  # not the fallback's 1.05
    # No platform section applies on the CPU: the CUDA-only setting stays out.
    assert thinker.engine_args.compilation_config is None


@pytest.mark.parametrize(
    "platform, check",
    [
        ("cuda", lambda s: s[0].engine_args.compilation_config == {"custom_ops": ["+rotary_embedding"]}),
        (
            "npu",
            lambda s: (
                (
                    s[0].engine_args.tensor_parallel_size,
                    s[0].runtime.devices,
                    s[0].engine_args.max_num_batched_tokens,
                    s[0].engine_args.gpu_memory_utilization,
                    s[0].engine_args.compilation_config,
                    s[1].runtime.devices,
                    s[2].engine_args.gpu_memory_utilization,
                )
                == (2, "0,1", 8192, 0.6, {"cudagraph_mode": "PIECEWISE"}, "2", 0.3)
            ),
        ),
        (
            "xpu",
            lambda s: (
                (
                    s[0].engine_args.tensor_parallel_size,
                    s[0].runtime.devices,
                    s[0].engine_args.max_cudagraph_capture_size,
                    s[2].runtime.devices,
                )
                == (4, "0,1,2,3", 0, "4")
            ),
        ),
        ("rocm", lambda s: (s[2].engine_args.enforce_eager, s[0].engine_args.enforce_eager) == (True, False)),
        (
            "musa",
            lambda s: (
                s[1].engine_args.hf_overrides == {"quantization_config": None}
                and s[0].engine_args.hf_overrides is None
            ),
        ),
    ],
)
def test_platform_sections_apply_to_their_platform_only(wheel_dir, platform, check):
    cfg = load_deploy_config(wheel_dir / "qwen3_omni_moe.yaml", platform=platform)
    assert check(cfg.stages)
    # Keys the platform does not touch are kept (merged, not replaced).
    assert cfg.stages[0].engine_args.moe_backend == "triton"
    assert cfg.stages[0].default_sampling_params.max_tokens == 2048


def test_thinking_file_is_the_thinker_only_pipeline(wheel_dir):
    loaded = load_deploy(wheel_dir / "qwen3_omni_moe_thinking.yaml", platform="cuda")
    (stage,) = loaded.config.stages
    assert loaded.pipeline == "qwen3_omni_moe_thinker_only"
    assert (stage.model_stage, stage.final_output_type, stage.engine_args.engine_output_type) == (
        "thinker",
        "text",
        "text",
    )
    assert loaded.config.async_chunk is False  # one stage: nothing to stream to (as vllm-omni)
    args = stage.engine_args
    assert (args.tensor_parallel_size, args.max_num_seqs, args.enforce_eager) == (2, 1, True)
    # Pipeline-wide settings reach the stage.
    assert (args.distributed_executor_backend, args.enable_prefix_caching) == ("mp", True)
    assert stage.runtime.devices == "0,1"
    assert stage.default_sampling_params.top_p == 0.9 and stage.default_sampling_params.seed == 42


def test_duplex_file_is_refused_naming_session_mode(wheel_dir):
    issue = _one_issue(
        wheel_dir / "qwen3_omni_duplex.yaml",
        "session_mode",
        "'duplex'",
        "omni-pd serves one turn per request",
        "allowed: 'turn'",
    )
    assert str(wheel_dir / "qwen3_omni_duplex.yaml") in issue


def test_duplex_file_in_turn_mode_inherits_its_base(wheel_dir, tmp_path):
    # Negative control of the refusal above: the same file with session_mode turn loads, and its
    # base_config (qwen3_omni_moe.yaml, next to it) fills in everything it does not set.
    raw = _raw(wheel_dir / "qwen3_omni_duplex.yaml")
    raw["session_mode"] = "turn"
    (tmp_path / "qwen3_omni_moe.yaml").write_text((wheel_dir / "qwen3_omni_moe.yaml").read_text())
    loaded = load_deploy(_write(tmp_path / "turn.yaml", raw), platform="cpu")
    thinker = loaded.config.stages[0]
    assert thinker.engine_args.limit_mm_per_prompt == {"audio": 4, "image": 8}
    assert thinker.engine_args.max_num_seqs == 64 and thinker.runtime.devices == "0"
    assert len(loaded.config.stages) == 3
    assert loaded.files == (str(tmp_path / "turn.yaml"), str(tmp_path / "qwen3_omni_moe.yaml"))


def test_mori_file_takes_code2wav_chunking_from_its_connector(wheel_dir):
    cfg = load_deploy_config(wheel_dir / "qwen3_omni_moe_mori_intranode.yaml", platform="rocm")
    code2wav = cfg.stages[2].engine_args
    assert (code2wav.codec_chunk_frames, code2wav.codec_left_context_frames) == (25, 25)
    assert "initial_codec_chunk_frames" not in code2wav.model_fields_set  # not in the connector
    assert cfg.runtime.connectors["mori_connector"].name == "MoriTransferEngineConnector"
    assert cfg.stages[0].output_connectors == {"to_stage_1": "mori_connector"}
    assert (code2wav.max_num_seqs, code2wav.max_num_batched_tokens) == (1, 51200)


# --- base_config inheritance ----------------------------------------------------------------


def test_base_config_overlay_merges_stages_connectors_and_platforms(wheel_dir, tmp_path):
    (tmp_path / "base").mkdir()
    base = (wheel_dir / "qwen3_omni_moe.yaml").read_text()
    (tmp_path / "base" / "qwen3_omni_moe.yaml").write_text(base)
    overlay = _write(
        tmp_path / "mine.yaml",
        {
            "base_config": "base/qwen3_omni_moe.yaml",
            "dtype": "bfloat16",
            "connectors": {"connector_of_shared_memory": {"extra": {"codec_chunk_frames": 50}}},
            "stages": [
                {"stage_id": 1, "devices": "2", "default_sampling_params": {"max_tokens": 100}},
                {"stage_id": 2, "engine_args": {"max_num_seqs": 8}},
            ],
            "platforms": {"npu": {"stages": [{"stage_id": 0, "devices": "4,5"}]}},
        },
    )
    cfg = load_deploy_config(overlay, platform="cpu")
    thinker, talker, code2wav = cfg.stages
    assert [s.engine_args.dtype for s in cfg.stages] == ["bfloat16"] * 3  # pipeline-wide
    assert talker.runtime.devices == "2" and talker.engine_args.gpu_memory_utilization == 0.6
    # default_sampling_params merge key by key over the base's.
    assert (
        talker.default_sampling_params.max_tokens,
        talker.default_sampling_params.temperature,
        talker.default_sampling_params.top_k,
    ) == (100, 0.9, 50)
    assert code2wav.engine_args.max_num_seqs == 8  # nested engine_args: the same key as flat
    assert code2wav.engine_args.max_num_batched_tokens == 65536
    # connectors merge recursively: the overlay's one key, the base's others.
    assert (
        code2wav.engine_args.initial_codec_chunk_frames,
        code2wav.engine_args.codec_chunk_frames,
        code2wav.engine_args.codec_left_context_frames,
    ) == (4, 50, 25)
    # platforms merge per platform and stage: the overlay's devices, the base's npu settings.
    npu = load_deploy_config(overlay, platform="npu").stages[0]
    assert (npu.runtime.devices, npu.engine_args.tensor_parallel_size) == ("4,5", 2)


def test_a_problem_names_the_file_that_holds_the_key(wheel_dir, tmp_path):
    base = _raw(wheel_dir / "qwen3_omni_moe.yaml")
    _file_stage(base, 2)["max_num_seqs"] = 0
    _write(tmp_path / "base.yaml", base)
    overlay = _write(
        tmp_path / "overlay.yaml",
        {"base_config": "base.yaml", "stages": [{"stage_id": 1, "gpu_memory_utilization": 1.5}]},
    )
    issues = _issues(overlay, platform="cpu")
    assert len(issues) == 2, issues
    assert any(
        i.startswith(f"{tmp_path / 'base.yaml'}: stage 2: stages[stage_id=2].max_num_seqs") for i in issues
    ), issues
    assert any(
        i.startswith(f"{overlay}: stage 1: stages[stage_id=1].gpu_memory_utilization") for i in issues
    ), issues


@pytest.mark.parametrize(
    "base_config, needle",
    [
        ("missing.yaml", "not found"),
        ("overlay.yaml", "base_config cycle"),
    ],
)
def test_a_bad_base_config_is_named(tmp_path, base_config, needle):
    path = _write(tmp_path / "overlay.yaml", {"base_config": base_config, "stages": [{"stage_id": 0}]})
    _one_issue(path, "base_config", needle)


# --- refused and unknown keys ---------------------------------------------------------------


def _tiny(tmp_path: Path, name: str = "tiny.yaml", *, pd: bool = False, **top: Any) -> Path:
    raw = _raw(SHIPPED / ("qwen3_omni_tiny_pd.yaml" if pd else "qwen3_omni_tiny.yaml"))
    raw.update(top)
    return _write(tmp_path / name, raw)


def _edit_stage(path: Path, stage_id: int, **keys: Any) -> Path:
    raw = _raw(path)
    _file_stage(raw, stage_id).update(keys)
    return _write(path, raw)


def test_the_tiny_files_load(tmp_path):
    assert len(load_deploy_config(_tiny(tmp_path)).stages) == 3


@pytest.mark.parametrize(
    "top, needles",
    [
        ({"async_chunks": False}, ("async_chunks", "did you mean 'async_chunk'?")),
        ({"session_mode": "duplex"}, ("session_mode", "duplex sessions")),
        ({"duplex_session": {"max_sessions": 2}}, ("duplex_session", "duplex sessions")),
        ({"model_runner": "v2"}, ("model_runner", "model runner v2")),
        ({"active_stream_window": 2}, ("active_stream_window", "engines batch every running request")),
        ({"forced_aligner": {"model": "x"}}, ("forced_aligner", "forced-aligner stage")),
        ({"custom_voice_dir": "/voices"}, ("custom_voice_dir", "checkpoint's voices")),
        ({"pipeline": "qwen3_omni_mo"}, ("pipeline", "did you mean 'qwen3_omni_moe'?")),
        ({"platforms": {"cdua": {"stages": []}}}, ("platforms.cdua", "did you mean 'cuda'?")),
        (
            {"edges": [{"from": 0, "to": 2}]},
            ("edges[0]", "edge 0 -> 2 disagrees with pipeline qwen3_omni_moe", "0 -> 1, 1 -> 2"),
        ),
        ({"edges": [{"from": 0, "to": 1, "window": 4}]}, ("edges[0].window", "did you mean 'window_size'?")),
        ({"dtype": "float64"}, ("top level: dtype", "float32")),
    ],
)
def test_top_level_keys_are_refused_by_name(tmp_path, top, needles):
    _one_issue(_tiny(tmp_path, **top), *needles)


@pytest.mark.parametrize(
    "top",
    [
        {"session_mode": "turn"},
        {"model_runner": "v1"},
        {"active_stream_window": 0},
        {"edges": [{"from": 1, "to": 2, "window_size": -1, "max_inflight": 1}]},
        {"pipeline": "qwen3_omni_moe"},
    ],
)
def test_their_no_op_values_load(tmp_path, top):
    # Negative controls of the refusals above.
    assert len(load_deploy_config(_tiny(tmp_path, **top)).stages) == 3


def test_num_replicas_becomes_the_stages_runtime_key(tmp_path):
    stages = load_deploy_config(_edit_stage(_tiny(tmp_path), 1, num_replicas=2)).stages
    assert [s.runtime.num_replicas for s in stages] == [1, 2, 1]


def test_top_level_ray_backend_puts_every_stage_on_ray(tmp_path):
    path = _edit_stage(
        _tiny(tmp_path, distributed_executor_backend="ray"), 0, runtime={"ray_resources": {"thinker_node": 1}}
    )
    stages = load_deploy_config(path).stages
    assert [s.engine_args.distributed_executor_backend for s in stages] == ["ray"] * 3
    assert stages[0].runtime.ray_resources == {"thinker_node": 1}


@pytest.mark.parametrize(
    "stage_id, keys, needles",
    [
        (0, {"max_num_seq": 8}, ("stages[stage_id=0].max_num_seq", "did you mean 'max_num_seqs'?")),
        (
            0,
            {"engine_args": {"gpu_memory_utilisation": 0.5}},
            ("stages[stage_id=0].gpu_memory_utilisation", "did you mean 'gpu_memory_utilization'?"),
        ),
        (0, {"device": "0"}, ("stages[stage_id=0].device", "did you mean 'devices'?")),
        (1, {"num_replicas": 0}, ("stages[stage_id=1].runtime.num_replicas", "greater than or equal to 1")),
        (1, {"async_chunk": False}, ("stages[stage_id=1].async_chunk", "pipeline-wide only")),
        (
            1,
            {"model_stage": "thinker"},
            (
                "stages[stage_id=1].model_stage",
                "set by pipeline qwen3_omni_moe (stage 1 is its talker stage)",
            ),
        ),
        (2, {"default_pooling_params": {"x": 1}}, ("default_pooling_params", "pooling")),
        (2, {"num_threads": 2}, ("stages[stage_id=2].num_threads", "under the stage's runtime:")),
        (2, {"max_num_seqs": 0}, ("stages[stage_id=2].max_num_seqs", "greater than or equal to 1")),
        (
            1,
            {"input_connectors": {"from_stage_0": "nope"}},
            (
                "stages[stage_id=1].input_connectors.from_stage_0",
                "connector 'nope' is not declared under connectors",
            ),
        ),
        (
            2,
            {"default_sampling_params": {"max_tokens": 0}},
            ("stages[stage_id=2].default_sampling_params.max_tokens", "positive"),
        ),
    ],
)
def test_stage_keys_are_refused_by_name(tmp_path, stage_id, keys, needles):
    _one_issue(_edit_stage(_tiny(tmp_path), stage_id, **keys), *needles)


def test_stage_no_op_values_load(tmp_path):
    path = _edit_stage(
        _tiny(tmp_path), 1, num_replicas=1, async_chunk=True, runtime={"num_threads": 2, "devices": "0"}
    )
    talker = load_deploy_config(path).stages[1]
    assert (talker.runtime.num_threads, talker.runtime.devices) == (2, "0")


def test_a_stage_the_pipeline_lacks_is_refused(tmp_path):
    raw = _raw(_tiny(tmp_path))
    raw["stages"].append({"stage_id": 5, "max_num_seqs": 2})
    _one_issue(
        _write(tmp_path / "extra.yaml", raw),
        "stages[stage_id=5].stage_id",
        "pipeline qwen3_omni_moe has no stage 5",
    )


def test_a_platform_stage_the_pipeline_lacks_is_refused_on_every_platform(tmp_path):
    # vllm-omni ignores it silently; a typo must not be lost, even in another platform's section.
    path = _tiny(tmp_path, platforms={"npu": {"stages": [{"stage_id": 5, "devices": "1"}]}})
    for platform in ("cpu", "npu"):
        _one_issue(
            path,
            "platforms.npu.stages[stage_id=5].stage_id",
            "platform npu overrides stage 5, which pipeline qwen3_omni_moe does not have",
            platform=platform,
        )


def test_a_platform_section_may_override_a_stage_the_file_does_not_list(tmp_path):
    raw = _raw(_tiny(tmp_path))
    raw["stages"] = [s for s in raw["stages"] if s["stage_id"] != 2]
    raw["platforms"] = {"cpu": {"stages": [{"stage_id": 2, "load_format": "dummy", "seed": 7}]}}
    cfg = load_deploy_config(_write(tmp_path / "plat.yaml", raw), platform="cpu")
    assert cfg.stages[2].engine_args.seed == 7
    assert cfg.stages[2].default_sampling_params.max_tokens == 65536  # the pipeline's fallback


def test_platform_problems_name_the_platform_section(tmp_path):
    path = _tiny(tmp_path, platforms={"cpu": {"stages": [{"stage_id": 0, "max_num_seqs": -1}]}})
    _one_issue(path, "platforms.cpu.stages[stage_id=0].max_num_seqs", platform="cpu")
    assert load_deploy_config(path, platform="cuda")  # the cpu section does not apply there


def test_a_legacy_file_given_as_deploy_config_says_what_to_do():
    _one_issue(CI / "qwen3_omni_tiny.yaml", "stage_args", "legacy stage_args schema", "--stage-configs-path")


def test_stage_configs_path_loads_either_schema():
    assert len(load_pipeline_config(SHIPPED / "qwen3_omni_tiny_pd.yaml").stages) == 4
    assert len(load_pipeline_config(CI / "qwen3_omni_tiny_pd.yaml").stages) == 4


def test_async_omni_takes_one_config():
    with pytest.raises(ValueError, match="not both"):
        AsyncOmni(
            stage_configs_path=CI / "qwen3_omni_tiny.yaml", deploy_config=SHIPPED / "qwen3_omni_tiny.yaml"
        )


# --- P/D in the deploy schema (criterion 3) --------------------------------------------------


def _as_run(cfg: PipelineConfig) -> dict[str, Any]:
    """What running a pipeline depends on: every stage field, the engine_args an hf stage reads,
    the effective batching limits. Left out: connector wiring (declarations: omni-pd moves stage
    outputs itself), runtime.max_batch_size (vllm-omni's spelling of max_num_seqs, compared as
    max_num_seqs) and code2wav's sampling params (its engine reads none)."""
    stages = []
    for s in cfg.stages:
        d = s.model_dump()
        d["engine_args"] = {k: v for k, v in d["engine_args"].items() if k in HF_ENGINE_KEYS}
        d["runtime"].pop("max_batch_size")
        d.update(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens)
        for key in ("input_connectors", "output_connectors"):
            d.pop(key)
        if s.model_stage == "code2wav":
            d.pop("default_sampling_params")
        stages.append(d)
    return {"stages": stages, "async_chunk": cfg.async_chunk, "edges": cfg.edges()}


@pytest.mark.parametrize(
    "deploy, stage_args",
    [
        ("qwen3_omni_tiny_pd.yaml", "qwen3_omni_tiny_pd.yaml"),
        ("qwen3_omni_tiny.yaml", "qwen3_omni_tiny.yaml"),
    ],
)
def test_tiny_deploy_files_equal_their_stage_args_twins(deploy, stage_args, tmp_path):
    got = _as_run(load_deploy_config(SHIPPED / deploy))
    want = _as_run(load_pipeline_config(CI / stage_args))
    assert got == want
    # Negative control: one value changed in the deploy file is noticed.
    changed = _edit_stage(_write(tmp_path / deploy, _raw(SHIPPED / deploy)), 1, seed=7)
    assert _as_run(load_deploy_config(changed)) != want


def test_pd_pipeline_is_chosen_by_the_marks(tmp_path):
    raw = _raw(SHIPPED / "qwen3_omni_tiny_pd.yaml")
    del raw["pipeline"]
    loaded = load_deploy(_write(tmp_path / "auto.yaml", raw))
    assert loaded.pipeline == "qwen3_omni_moe_pd"
    assert [(s.is_prefill_only, s.is_decode_only) for s in loaded.config.stages] == [
        (True, False),
        (False, True),
        (False, False),
        (False, False),
    ]
    assert loaded.config.stage(2).engine_input_source == (1,)
    # And by the key alone: the marks may be left to the pipeline.
    for stage in raw["stages"]:
        stage.pop("is_prefill_only", None)
        stage.pop("is_decode_only", None)
    raw["pipeline"] = "qwen3_omni_moe_pd"
    cfg = load_deploy_config(_write(tmp_path / "keyed.yaml", raw))
    assert (cfg.stage(0).is_prefill_only, cfg.stage(1).is_decode_only) == (True, True)


def _pd(tmp_path: Path, stage_id: int, **keys: Any) -> Path:
    return _edit_stage(_tiny(tmp_path, "pd.yaml", pd=True), stage_id, **keys)


def _kv(path: Path, stage_id: int, **changes: Any) -> Path:
    raw = _raw(path)
    _file_stage(raw, stage_id)["kv_transfer_config"].update(changes)
    return _write(path, raw)


@pytest.mark.parametrize(
    "make, needles",
    [
        (
            lambda p: _pd(p, 1, is_prefill_only=True),
            ("stages[stage_id=1].is_prefill_only", "its thinker decode stage, not a prefill stage"),
        ),
        (
            lambda p: _pd(p, 0, is_prefill_only=False),
            ("stages[stage_id=0].is_prefill_only", "thinker prefill stage of pipeline qwen3_omni_moe_pd"),
        ),
        (lambda p: _pd(p, 2, is_decode_only=True), ("stages[stage_id=2].is_decode_only", "talker stage")),
        (
            lambda p: _kv(_tiny(p, "pd.yaml", pd=True), 1, kv_role="kv_producer"),
            ("stages[stage_id=1].kv_transfer_config.kv_role", "wrong kv_role for the decode side"),
        ),
        (
            lambda p: _kv(_tiny(p, "pd.yaml", pd=True), 1, engine_id="tiny-thinker-prefill"),
            ("stages[stage_id=1].kv_transfer_config.engine_id", "shared with prefill stage 0"),
        ),
        (
            lambda p: _kv(_tiny(p, "pd.yaml", pd=True), 1, kv_connector="NixlConnector"),
            ("stages[stage_id=1].kv_transfer_config.kv_connector", "same connector"),
        ),
        (
            lambda p: _pd(p, 1, kv_transfer_config=None),
            ("stages[stage_id=1].kv_transfer_config", "needs a kv_transfer_config"),
        ),
        (
            lambda p: _pd(p, 1, tensor_parallel_size=2),
            ("stages[stage_id=1].tensor_parallel_size", "identical layouts"),
        ),
        (
            lambda p: _kv(_tiny(p, "pd.yaml", pd=True), 0, kv_connector_extra_config={"kv_miss_window_s": 2}),
            (
                "stages[stage_id=0].kv_transfer_config.kv_connector_extra_config.kv_miss_window_s",
                "the decode stage's value governs",
            ),
        ),
        (
            lambda p: _tiny(p, "pd.yaml", pd=True, pipeline="qwen3_omni_moe"),
            (
                "stages[stage_id=0].is_prefill_only",
                "pipeline qwen3_omni_moe has no prefill/decode stages",
                "pipeline: qwen3_omni_moe_pd",
            ),
        ),
    ],
)
def test_every_pd_check_applies_to_deploy_files(tmp_path, make, needles):
    issues = _issues(make(tmp_path))
    assert any(all(n in issue for n in needles) for issue in issues), "\n".join(issues)


def test_validate_config_shows_the_deploy_pd_pair(capsys):
    for argv in (
        ["validate-config", str(SHIPPED / "qwen3_omni_tiny_pd.yaml")],
        ["validate-config", "--deploy-config", str(SHIPPED / "qwen3_omni_tiny_pd.yaml")],
    ):
        assert cli_main(argv) == 0
        out = capsys.readouterr().out
        assert "pipeline qwen3_omni_moe_pd: 0 thinker prefill, 1 thinker decode, 2 talker, 3 code2wav" in out
        assert "P/D: prefill stage 0 -> decode stage 1 via MooncakeConnector" in out
        assert "[1] thinker   engine=hf   role=decode-only  inputs=[0] final_output=text" in out


def test_validate_config_platform_flag_and_exit_codes(wheel_dir, capsys):
    assert (
        cli_main(
            [
                "validate-config",
                "--deploy-config",
                str(wheel_dir / "qwen3_omni_moe.yaml"),
                "--platform",
                "npu",
            ]
        )
        == 0
    )
    assert "platform npu: its platforms section applied" in capsys.readouterr().out
    duplex = str(wheel_dir / "qwen3_omni_duplex.yaml")
    assert cli_main(["validate-config", "--deploy-config", duplex]) == 2
    assert "session_mode" in capsys.readouterr().err
    assert cli_main(["validate-config"]) == 2
    assert "give one stage YAML" in capsys.readouterr().err


def test_real_model_pd_example_loads():
    out = io.StringIO()
    assert run_validate(str(SHIPPED / "qwen3_omni_moe_pd.yaml"), out=out, platform="cuda") == 0
    assert "P/D: prefill stage 0 -> decode stage 1" in out.getvalue()
    cfg = load_deploy_config(SHIPPED / "qwen3_omni_moe_pd.yaml", platform="cuda")
    prefill, decode, talker, code2wav = cfg.stages
    # hf stages: no GPU and no tensor parallelism promised (tests/test_devices.py checks them all)
    assert [s.runtime.devices for s in cfg.stages] == [None] * 4
    assert prefill.engine_args.tensor_parallel_size == decode.engine_args.tensor_parallel_size == 1
    assert (prefill.kv_transfer_config.bootstrap_port, decode.kv_transfer_config.bootstrap_port) == (
        25201,
        25202,
    )
    assert {s.engine_args.dtype for s in cfg.stages} == {"bfloat16"}
    assert code2wav.engine_args.codec_chunk_frames == 25
