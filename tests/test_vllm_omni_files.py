"""vllm-omni's own Qwen3-Omni stage files load unchanged (issue 12, criterion 1), and its
Qwen2.5-Omni ones too (issue 49, criterion 2).

The files are read from vllm-omni's published wheel (fetched once with `pip download --no-deps`
into .cache/, never copied into the repository: tests/vllm_omni_wheels.py). 0.18.0 is the last
release that ships the legacy `stage_args` files; its P/D separation file lives only in vllm-omni's repository, so the
P/D case is tests/fixtures/vllm_omni_style_pd.yaml (tests/test_config.py).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from vllm_omni_wheels import vllm_omni_wheel

from omni_pd.entrypoints.validate import run_validate

LEGACY_VERSION = "0.18.0"
LEGACY_FILES = [
    "vllm_omni/model_executor/stage_configs/qwen3_omni_moe.yaml",
    "vllm_omni/model_executor/stage_configs/qwen3_omni_moe_async_chunk.yaml",
    "vllm_omni/model_executor/stage_configs/qwen3_omni_moe_multiconnector.yaml",
    "vllm_omni/platforms/npu/stage_configs/qwen3_omni_moe.yaml",
    "vllm_omni/platforms/npu/stage_configs/qwen3_omni_moe_async_chunk.yaml",
    "vllm_omni/platforms/rocm/stage_configs/qwen3_omni_moe.yaml",
    "vllm_omni/platforms/xpu/stage_configs/qwen3_omni_moe.yaml",
]
QWEN2_5_FILES = [
    "vllm_omni/model_executor/stage_configs/qwen2_5_omni.yaml",
    "vllm_omni/model_executor/stage_configs/qwen2_5_omni_multiconnector.yaml",
    "vllm_omni/platforms/npu/stage_configs/qwen2_5_omni.yaml",
    "vllm_omni/platforms/rocm/stage_configs/qwen2_5_omni.yaml",
    "vllm_omni/platforms/xpu/stage_configs/qwen2_5_omni.yaml",
]


@pytest.fixture(scope="module")
def legacy_files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("vllm_omni_legacy")
    with zipfile.ZipFile(vllm_omni_wheel(LEGACY_VERSION)) as wheel:
        files = {}
        for name in LEGACY_FILES + QWEN2_5_FILES:
            path = out / name.replace("/", "__")
            path.write_bytes(wheel.read(name))
            files[name] = path
    return files


@pytest.mark.parametrize("name", LEGACY_FILES)
def test_legacy_qwen3_omni_file_validates(legacy_files, name):
    out, err = io.StringIO(), io.StringIO()
    assert run_validate(str(legacy_files[name]), out=out, err=err) == 0, err.getvalue()
    summary = out.getvalue()
    assert "[1] talker" in summary and "[2] code2wav" in summary
    assert "edges: 0 -> 1, 1 -> 2" in summary
    if "async_chunk" in name:  # the processors named on the producing stages were found
        assert "streamed edges: 0 -> 1, 1 -> 2" in summary
    # Keys the hf engine does not use are named, with why, not silently dropped.
    assert "the hf engine does not use" in summary and "gpu_memory_utilization" in summary


@pytest.mark.parametrize("name", QWEN2_5_FILES)
def test_legacy_qwen2_5_omni_file_validates(legacy_files, name):
    from omni_pd.config import load_pipeline_config

    out, err = io.StringIO(), io.StringIO()
    assert run_validate(str(legacy_files[name]), out=out, err=err) == 0, err.getvalue()
    summary = out.getvalue()
    assert "[0] thinker" in summary and "[1] talker" in summary and "[2] code2wav" in summary
    assert "edges: 0 -> 1, 1 -> 2" in summary
    # Its processors are Qwen2.5-Omni's own here, not Qwen3-Omni's.
    talker = load_pipeline_config(legacy_files[name]).stage(1)
    assert (
        talker.custom_process_input_func
        == "omni_pd.models.qwen2_5_omni.stage_input_processors.thinker2talker"
    )
