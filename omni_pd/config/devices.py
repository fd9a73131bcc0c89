"""What an hf stage can promise about devices, checked before any worker starts.

The hf engine runs each stage in one process on the CPU (its CUDA path is issue 13). A stage
file that asks an hf stage for GPUs (`runtime.devices`) or for tensor parallelism would
otherwise run a 30B model on the CPU without a word: it is refused, naming the stage and the key,
unless the user passes `--device cpu` (every hf stage on the CPU, said in one log line), which is
how a GPU config is tried on a laptop.
"""
from __future__ import annotations

import logging

from .schema import PipelineConfig

log = logging.getLogger(__name__)
DEVICE_CHOICES = ("auto", "cpu")


class DeviceError(ValueError):
    """The stage file asks an hf stage for what it cannot do here."""


def device_problems(config: PipelineConfig, cuda_available: bool) -> list[str]:
    problems: list[str] = []
    for stage in config.stages:
        if stage.engine != "hf":
            continue  # vLLM places and shards its own stages
        name = f"stage {stage.stage_id} ({stage.model_stage})"
        tp = stage.engine_args.tensor_parallel_size
        if tp > 1:
            problems.append(f"{name}: engine_args.tensor_parallel_size is {tp}, but the hf engine "
                            "runs a stage in one process on one device; set it to 1, or use "
                            "engine: vllm for tensor parallelism")
        devices = stage.runtime.devices
        if devices:
            where = ("this machine has no GPU torch can use" if not cuda_available else
                     "the hf engine runs on the CPU in this version")
            problems.append(f"{name}: runtime.devices is {devices!r}, but {where}; remove "
                            "runtime.devices to run the stage on the CPU, or use engine: vllm")
    return problems


def check_devices(config: PipelineConfig, device: str = "auto",
                  cuda_available: bool | None = None) -> None:
    """Raise DeviceError listing every device promise the hf stages cannot keep, or (with
    `device="cpu"`) log once what is set aside."""
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {list(DEVICE_CHOICES)}, got {device!r}")
    if cuda_available is None:
        import torch
        cuda_available = torch.cuda.is_available()
    problems = device_problems(config, cuda_available)
    if device == "cpu":
        log.info("--device cpu: every hf stage runs on the CPU%s", (
            "; set aside: " + "; ".join(p.split(", but")[0] for p in problems)) if problems else "")
        return
    if problems:
        raise DeviceError("\n".join(problems) + "\n(or pass --device cpu / Omni(device='cpu') to "
                          "run every hf stage on the CPU, e.g. to try a GPU config without a GPU)")
