"""The torch device a stage worker computes on: entering it, and moving requests onto it.

A stage worker owns one device for its life. On a GPU it makes that device torch's default
(`torch.set_default_device`), so the engines' step tensors (positions, block tables, masks)
are made where the model's weights and the paged cache live, without a device argument at each
of the engines' many small constructors; the same code runs on the CPU, where nothing changes.
Messages carry tensors as host values (`orchestrator.messages`): `to_device` moves a request's
inputs onto the engine's device when it arrives, and results leave as host values again.

Exactness on CUDA: the engines' batch invariance rests on fixed 16-row tiles (every matmul of a
row sees the same shapes whatever the batch), so a row's bits do not depend on which kernel
cuBLAS picks for the batch's row count, provided nothing changes precision behind our back.
`enter` therefore turns off TF32 and reduced-precision reductions for matmuls and convolutions;
cuBLAS is deterministic for a given shape and stream without atomics (its split-K variants
reduce in a fixed order), which is what a fixed tile shape relies on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
_said: set[str] = set()


def enter(device: str) -> torch.device:
    """Make `device` this process's compute device. Nothing changes for the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.set_default_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        log.info(
            "computing on %s (%s); TF32 and reduced-precision reductions off",
            dev,
            torch.cuda.get_device_name(dev),
        )
    return dev


def kernels_for(
    device: torch.device | str, requested: str, what: str, stage_id: int, dtype: torch.dtype = torch.float32
) -> str:
    """The kernels a stage can run on `device` in `dtype`: omni-pd's C kernels ("native") read
    host memory and compute float32, so on a GPU or in another dtype they give way to torch's,
    said once per stage and kind."""
    on_gpu = torch.device(device).type != "cpu"
    if requested in ("native", "auto") and (on_gpu or dtype != torch.float32):
        key = f"{stage_id}:{what}"
        if key not in _said:
            _said.add(key)
            log.info(
                "stage %d: %s on %s in %s use torch's kernels (the C kernels compute float32 on the CPU)",
                stage_id,
                what,
                device,
                str(dtype).removeprefix("torch."),
            )
        return "torch"
    return requested


def check_dtype(device: torch.device | str, dtype: torch.dtype, stage_id: int) -> None:
    """Refuse, at start, a half-precision hf stage on a CPU level with no arithmetic for it:
    torch would run it through float32 conversions, slower than float32 itself."""
    if torch.device(device).type != "cpu" or dtype == torch.float32:
        return
    from .hf.compute_identity import cpu_capability

    name = str(dtype).removeprefix("torch.")
    flags = _cpu_flags()
    wanted = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}.get(name, ())
    level = cpu_capability()
    present = any(f in flags for f in wanted)
    if level != "avx512" or not present:
        instructions = "/".join(wanted) or f"no {name} instructions"
        raise ValueError(
            f"stage {stage_id}: engine_args.dtype {name} on this CPU (torch's level {level}; "
            f"{instructions} {'present' if present else 'absent'}) has no {name} kernels: "
            "set dtype: float32, or run the stage on a GPU (runtime.devices)"
        )


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def to_device(value: Any, device: torch.device | str) -> Any:
    """`value` with every tensor in it (in dataclasses, dicts, lists and tuples) on `device`;
    the same object when nothing moves."""
    dev = torch.device(device)
    if isinstance(value, torch.Tensor):
        return value if value.device == dev else value.to(dev)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name)
            new = to_device(old, dev)
            if new is not old:
                changes[f.name] = new
        if not changes:
            return value
        moved = copy.copy(value)  # not replace(): fields with init=False stay as they are
        for name, new in changes.items():
            object.__setattr__(moved, name, new)  # frozen dataclasses too
        return moved
    if isinstance(value, dict):
        moved_map = {k: to_device(v, dev) for k, v in value.items()}
        return value if all(moved_map[k] is value[k] for k in value) else moved_map
    if isinstance(value, (list, tuple)):
        moved_items = [to_device(v, dev) for v in value]
        if all(a is b for a, b in zip(moved_items, value)):
            return value
        return type(value)(moved_items) if isinstance(value, list) else tuple(moved_items)
    return value
