"""Where an hf stage runs, checked before any worker starts and resolved inside the worker.

An hf stage whose `runtime.devices` names GPUs runs on `cuda:<first>` (the model, its paged KV
cache and its step tensors); one without runs on the CPU. What the hf engine cannot keep is
refused by name before any worker starts: tensor parallelism (one process, one device), and
GPUs on a host where torch sees none or fewer than named. `--device cpu` (`Omni(device="cpu")`)
runs every hf stage on the CPU anyway, said in one log line: how a GPU config is tried on a
laptop. Ray stages are placed on other nodes, whose GPUs this host cannot see: the worker makes
the same check where it runs (`stage_device`).
"""

from __future__ import annotations

import logging
import os

from .schema import PipelineConfig

log = logging.getLogger(__name__)
DEVICE_CHOICES = ("auto", "cpu")


class DeviceError(ValueError):
    """The stage file asks an hf stage for what it cannot do here."""


def device_list(devices: str | None) -> list[str]:
    return [d.strip() for d in (devices or "").split(",") if d.strip()]


def _stage_name(stage) -> str:
    return f"stage {stage.stage_id} ({stage.model_stage})"


def _visibility_problem(stage, visible: int) -> str | None:
    """Why the stage's GPUs cannot be had with `visible` CUDA devices, or None."""
    devices = stage.runtime.devices
    wanted = device_list(devices)
    if not wanted:
        return None
    if visible == 0:
        return (
            f"{_stage_name(stage)}: runtime.devices is {devices!r}, but no CUDA device is "
            "visible to torch on this host (torch.cuda.is_available() is False); remove "
            "runtime.devices to run the stage on the CPU"
        )
    bad = [d for d in wanted if not d.isdigit() or int(d) >= visible]
    if bad:
        return (
            f"{_stage_name(stage)}: runtime.devices is {devices!r}, but torch sees {visible} "
            f"CUDA device(s) (0..{visible - 1}); {bad} is not one of them: name visible GPU "
            "indices (as CUDA_VISIBLE_DEVICES renumbers them)"
        )
    return None


def device_problems(config: PipelineConfig, cuda_devices: int) -> list[str]:
    """Every device promise of the hf stages that this host cannot keep. Ray stages' GPUs are
    checked on their node (`stage_device`), not here."""
    problems: list[str] = []
    for stage in config.stages:
        if stage.engine != "hf":
            continue  # vLLM places and shards its own stages
        tp = stage.engine_args.tensor_parallel_size
        if tp > 1:
            problems.append(
                f"{_stage_name(stage)}: engine_args.tensor_parallel_size is {tp}, but "
                "the hf engine runs a stage in one process on one device; set it to "
                "1, or use engine: vllm for tensor parallelism"
            )
        if stage.engine_args.distributed_executor_backend == "ray":
            continue
        problem = _visibility_problem(stage, cuda_devices)
        if problem:
            problems.append(problem)
    return problems


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_devices(
    config: PipelineConfig, device: str = "auto", cuda_devices: int | None = None
) -> PipelineConfig:
    """The config the workers run: as given, or (with `device="cpu"`) with every hf stage's
    GPUs set aside, said in one log line. Raises DeviceError listing every device promise the
    hf stages cannot keep."""
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {list(DEVICE_CHOICES)}, got {device!r}")
    if device == "cpu":
        aside = [p.split(", but")[0] for p in device_problems(config, cuda_devices=0)]
        log.info(
            "--device cpu: every hf stage runs on the CPU%s",
            ("; set aside: " + "; ".join(aside)) if aside else "",
        )
        return on_cpu(config)
    problems = device_problems(config, visible_cuda_devices() if cuda_devices is None else cuda_devices)
    if problems:
        raise DeviceError(
            "\n".join(problems) + "\n(or pass --device cpu / Omni(device='cpu') to "
            "run every hf stage on the CPU, e.g. to try a GPU config without a GPU)"
        )
    return config


def on_cpu(config: PipelineConfig) -> PipelineConfig:
    """The config with no GPUs asked for hf stages (so none are reserved, by Ray either)."""
    stages = [
        s.model_copy(update={"runtime": s.runtime.model_copy(update={"devices": None})})
        if s.engine == "hf" and s.runtime.devices
        else s
        for s in config.stages
    ]
    return config.model_copy(update={"stage_args": tuple(stages)})


def stage_device(stage, cuda_devices: int | None = None) -> str:
    """Inside the stage's worker: the torch device an hf stage runs on, "cuda:<first of
    runtime.devices>" or "cpu". A Ray actor sees only the GPUs Ray gave it, renumbered from 0
    (`ray_workers` rewrites `runtime.devices` to match). Raises DeviceError, naming the stage,
    when those GPUs are not visible here."""
    wanted = device_list(stage.runtime.devices)
    if not wanted:
        return "cpu"
    problem = _visibility_problem(stage, visible_cuda_devices() if cuda_devices is None else cuda_devices)
    if problem:
        raise DeviceError(problem + f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return f"cuda:{int(wanted[0])}"
