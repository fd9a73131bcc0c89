"""Honest devices (issue 12, criterion 4): an hf stage that asks for GPUs or tensor parallelism
is refused before any worker starts, unless every hf stage is asked onto the CPU."""
import logging

import pytest

from omni_pd.config import load_pipeline_config
from omni_pd.config.devices import DeviceError, check_devices, device_problems
from omni_pd.orchestrator.async_omni import AsyncOmni
from omni_pd.paths import STAGE_CONFIGS_DIR

REAL = STAGE_CONFIGS_DIR / "qwen3_omni_moe.yaml"
TINY = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"


@pytest.fixture
def gpu_layout(tmp_path):
    """The real-model file with vllm-omni's GPU layout put back: thinker TP 2 on GPUs 0,1, talker
    on GPU 1 (what the shipped file no longer promises)."""
    text = REAL.read_text()
    text = text.replace("      process: true\n", "      process: true\n      devices: \"0,1\"\n", 1)
    text = text.replace("      model_stage: thinker\n",
                        "      model_stage: thinker\n      tensor_parallel_size: 2\n", 1)
    first = text.index("      devices: \"0,1\"\n") + 1
    second = text.index("      process: true\n", first)
    text = text[:second] + "      process: true\n      devices: \"1\"\n" + text[second + 20:]
    path = tmp_path / "qwen3_omni_moe_gpus.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("cuda", [False, True])
def test_gpu_asks_of_hf_stages_are_refused_naming_stage_and_key(cuda, gpu_layout):
    config = load_pipeline_config(gpu_layout, check_imports=False)
    with pytest.raises(DeviceError) as err:
        check_devices(config, "auto", cuda_available=cuda)
    message = str(err.value)
    assert "stage 0 (thinker): engine_args.tensor_parallel_size is 2" in message
    assert "stage 0 (thinker): runtime.devices is '0,1'" in message
    assert "stage 1 (talker): runtime.devices is '1'" in message
    assert ("no GPU torch can use" if not cuda else "runs on the CPU in this version") in message
    assert "--device cpu" in message


def test_device_cpu_runs_them_on_the_cpu_and_says_so_once(caplog, gpu_layout):
    config = load_pipeline_config(gpu_layout, check_imports=False)
    with caplog.at_level(logging.INFO, logger="omni_pd.config.devices"):
        check_devices(config, "cpu", cuda_available=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("--device cpu: every hf stage runs on the CPU")
    assert "tensor_parallel_size is 2" in lines[0] and "runtime.devices is '0,1'" in lines[0]


def test_a_cpu_config_passes_and_a_bad_choice_is_refused():
    config = load_pipeline_config(TINY)
    check_devices(config, "auto", cuda_available=False)  # asks for nothing it cannot have
    with pytest.raises(ValueError, match="device must be one of"):
        check_devices(config, "gpu")


def test_omni_refuses_before_starting_any_worker(tmp_path):
    text = TINY.read_text().replace("      process: true\n", "      process: true\n      devices: \"0\"\n", 1)
    path = tmp_path / "tiny_on_gpu0.yaml"
    path.write_text(text)
    with pytest.raises(DeviceError, match=r"stage 0 \(thinker\): runtime.devices is '0'"):
        AsyncOmni(stage_configs_path=path)  # raises in the constructor: no worker was spawned


SHIPPED = sorted(p for p in STAGE_CONFIGS_DIR.rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(STAGE_CONFIGS_DIR)))
def test_shipped_configs_promise_only_what_runs_here(path):
    """No shipped file asks an hf stage for a GPU or tensor parallelism, which would be refused
    at start-up on every machine (the real-model files included)."""
    config = load_pipeline_config(path, check_imports=False)
    assert device_problems(config, cuda_available=False) == []
    assert device_problems(config, cuda_available=True) == []
