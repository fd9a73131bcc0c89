"""Honest devices (issue 12, criterion 4): an hf stage that asks for GPUs or tensor parallelism
is refused before any worker starts, unless every hf stage is asked onto the CPU."""

import logging

import pytest

from omni_pd.config import load_pipeline_config
from omni_pd.config.devices import DeviceError, check_devices, device_problems, stage_device
from omni_pd.orchestrator.async_omni import AsyncOmni
from omni_pd.paths import STAGE_CONFIGS_DIR

REAL = STAGE_CONFIGS_DIR / "qwen3_omni_moe.yaml"
TINY = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"


@pytest.fixture
def gpu_layout(tmp_path):
    """The real-model file with vllm-omni's GPU layout put back: thinker TP 2 on GPUs 0,1, talker
    on GPU 1 (what the shipped file no longer promises)."""
    text = REAL.read_text()
    text = text.replace("      process: true\n", '      process: true\n      devices: "0,1"\n', 1)
    text = text.replace(
        "      model_stage: thinker\n", "      model_stage: thinker\n      tensor_parallel_size: 2\n", 1
    )
    first = text.index('      devices: "0,1"\n') + 1
    second = text.index("      process: true\n", first)
    text = text[:second] + '      process: true\n      devices: "1"\n' + text[second + 20 :]
    path = tmp_path / "qwen3_omni_moe_gpus.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("cuda", [0, 2])
def test_gpu_asks_of_hf_stages_are_checked_naming_stage_and_key(cuda, gpu_layout):
    config = load_pipeline_config(gpu_layout, check_imports=False)
    with pytest.raises(DeviceError) as err:
        check_devices(config, "auto", cuda_devices=cuda)
    message = str(err.value)
    assert "stage 0 (thinker): engine_args.tensor_parallel_size is 2" in message  # never on hf
    if cuda == 0:
        assert "stage 0 (thinker): runtime.devices is '0,1', but no CUDA device is visible" in message
        assert "stage 1 (talker): runtime.devices is '1', but no CUDA device is visible" in message
    else:  # two GPUs: the devices are fine, only tensor parallelism is refused
        assert "runtime.devices" not in message
    assert "--device cpu" in message


def test_gpus_beyond_those_visible_are_named(gpu_layout):
    text = gpu_layout.read_text().replace(
        "      model_stage: thinker\n      tensor_parallel_size: 2\n", "      model_stage: thinker\n", 1
    )
    gpu_layout.write_text(text)
    config = load_pipeline_config(gpu_layout, check_imports=False)
    problems = device_problems(config, cuda_devices=1)
    assert len(problems) == 2
    assert "torch sees 1 CUDA device(s) (0..0); ['1'] is not one of them" in problems[0]
    assert problems[0].startswith("stage 0 (thinker)") and problems[1].startswith("stage 1 (talker)")
    assert check_devices(config, "auto", cuda_devices=2) is config  # kept as it is


def test_device_cpu_runs_them_on_the_cpu_and_says_so_once(caplog, gpu_layout):
    config = load_pipeline_config(gpu_layout, check_imports=False)
    with caplog.at_level(logging.INFO, logger="omni_pd.config.devices"):
        on_cpu = check_devices(config, "cpu", cuda_devices=0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("--device cpu: every hf stage runs on the CPU")
    assert "tensor_parallel_size is 2" in lines[0] and "runtime.devices is '0,1'" in lines[0]
    # The workers get a config that asks for no GPU (so none is reserved, by Ray either) ...
    assert [s.runtime.devices for s in on_cpu.stages if s.engine == "hf"] == [None] * 3
    assert [stage_device(s, cuda_devices=0) for s in on_cpu.stages] == ["cpu"] * 3
    # ... and the file's own config is untouched.
    assert config.stages[0].runtime.devices == "0,1"


def test_a_stage_resolves_to_its_first_gpu_or_fails_naming_it(gpu_layout):
    config = load_pipeline_config(gpu_layout, check_imports=False)
    thinker, talker, code2wav = config.stages
    assert stage_device(thinker, cuda_devices=2) == "cuda:0"
    assert stage_device(talker, cuda_devices=2) == "cuda:1"
    assert stage_device(code2wav, cuda_devices=0) == "cpu"  # asks for no GPU
    with pytest.raises(
        DeviceError,
        match=r"stage 1 \(talker\): runtime.devices is '1', but no CUDA "
        r"device is visible.*CUDA_VISIBLE_DEVICES=",
    ):
        stage_device(talker, cuda_devices=0)


def test_a_cpu_config_passes_and_a_bad_choice_is_refused():
    config = load_pipeline_config(TINY)
    assert check_devices(config, "auto", cuda_devices=0) is config  # asks for nothing it cannot have
    with pytest.raises(ValueError, match="device must be one of"):
        check_devices(config, "gpu")


def test_the_engine_refuses_a_gpu_it_cannot_see_before_loading_the_model(tmp_path):
    """Where the orchestrator cannot check (a Ray stage on another node), the worker does: the
    engine's build fails at start, naming the stage and its devices."""
    from omni_pd.models.qwen3_omni.hf.build import build_hf_engine

    config = load_pipeline_config(TINY)
    stage = config.stages[1]
    stage = stage.model_copy(update={"runtime": stage.runtime.model_copy(update={"devices": "0"})})
    with pytest.raises(DeviceError, match=r"stage 1 \(talker\): runtime.devices is '0', but no CUDA"):
        build_hf_engine(stage, "tiny-qwen3-omni")


def test_omni_refuses_before_starting_any_worker(tmp_path):
    text = TINY.read_text().replace("      process: true\n", '      process: true\n      devices: "0"\n', 1)
    path = tmp_path / "tiny_on_gpu0.yaml"
    path.write_text(text)
    with pytest.raises(DeviceError, match=r"stage 0 \(thinker\): runtime.devices is '0'"):
        AsyncOmni(stage_configs_path=path)  # raises in the constructor: no worker was spawned


SHIPPED = sorted(p for p in STAGE_CONFIGS_DIR.rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(STAGE_CONFIGS_DIR)))
def test_shipped_configs_promise_only_what_runs(path):
    """No shipped file asks an hf stage for tensor parallelism, or for more than GPUs 0 and 1
    (only the 2-GPU real-model file names GPU 1); the files made for GPUs (their names say
    cuda) are refused where torch sees none, and every other one runs on a CPU host."""
    config = load_pipeline_config(path, check_imports=False)
    two = path.name == "qwen3_omni_moe_vllm_cuda.yaml"
    assert device_problems(config, cuda_devices=2 if two else 1) == []
    if two:
        assert device_problems(config, cuda_devices=1)  # GPU 1 named: refused on a 1-GPU host
    on_gpu = "cuda" in path.name
    assert bool(device_problems(config, cuda_devices=0)) == on_gpu


def test_c_kernels_give_way_to_torch_in_another_dtype_and_half_precision_needs_its_instructions(monkeypatch):
    """The C kernels compute float32: a bfloat16 stage runs torch's kernels (said once). A
    bfloat16 stage on a CPU level without bf16 arithmetic is refused at start, naming the key
    and what to set, instead of running slowly through conversions."""
    import torch

    from omni_pd.engines import device
    from omni_pd.engines.hf import compute_identity

    assert device.kernels_for("cpu", "native", "attention", 7, torch.bfloat16) == "torch"
    assert device.kernels_for("cpu", "native", "attention", 7, torch.float32) == "native"
    device.check_dtype("cpu", torch.float32, 3)  # float32 needs nothing
    monkeypatch.setattr(device, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(compute_identity, "cpu_capability", lambda: "avx512")
    device.check_dtype("cpu", torch.bfloat16, 3)
    for level, flags in (("avx2", {"avx512_bf16"}), ("avx512", {"avx512f"})):
        monkeypatch.setattr(device, "_cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(compute_identity, "cpu_capability", lambda level=level: level)
        with pytest.raises(ValueError, match=r"stage 3: engine_args.dtype bfloat16 .* set dtype: float32"):
            device.check_dtype("cpu", torch.bfloat16, 3)


def test_code2wav_kernels_auto_follows_the_decoder_width():
    """`auto`: the C kernels on the tiny model's narrow decoder, torch's at the real model's
    width (where they are faster); on a GPU or in bfloat16, torch's whatever was asked."""
    from types import SimpleNamespace

    import torch

    from omni_pd.engines import device
    from omni_pd.models.qwen3_omni.hf.build import code2wav_kernels

    assert code2wav_kernels("auto", SimpleNamespace(decoder_dim=64), 2) == "native"
    assert code2wav_kernels("auto", SimpleNamespace(decoder_dim=1536), 2) == "torch"
    assert code2wav_kernels("native", SimpleNamespace(decoder_dim=1536), 2) == "native"  # asked for
    assert device.kernels_for("cpu", "auto", "code2wav", 2, torch.bfloat16) == "torch"
