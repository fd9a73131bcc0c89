"""The one hf engine builder: a stage config and a model's runner factory in, a stage engine out.

What every hf stage does the same way lives here: the dtype it runs, the device it runs on (a
GPU that is not visible fails the stage by name), the attention kernels that device and dtype
allow, the timing and the one INFO line a deployer reads. A model package gives a factory that
loads its part of the checkpoint onto `HfStage.device` and returns its runner: an `ArRunner`
becomes the generic autoregressive engine (colocated, or a P/D leg by the stage's role), a
`ChunkRunner` the chunked decoder's engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar, Union

import torch

from ...config.devices import stage_device
from ..base import StageEngine
from ..core.build import ar_engine
from ..core.chunked import ChunkedEngine
from ..core.runner import ArRunner, ChunkRunner
from ..device import check_dtype, enter as enter_device, kernels_for

log = logging.getLogger(__name__)
Placed = TypeVar("Placed")

# engine_args.dtype -> torch dtype, for every hf stage (a model may allow fewer: `dtypes`).
DTYPES: Mapping[str, torch.dtype] = {
    "auto": torch.float32,
    "float": torch.float32,
    "float32": torch.float32,
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class HfStage:
    """What a model's runner factory is given: the stage, and where and how it runs."""

    config: Any  # the stage's StageConfig
    model: str  # the stage's engine_args.model, else the pipeline's
    device: str
    dtype: torch.dtype
    attention_kernels: str  # engine_args.attention_kernels, resolved for the device and dtype

    def place(self, module: Placed) -> Placed:
        """`module` (anything with torch's `.to`) on the stage's device, entering it first."""
        if self.device == "cpu":
            return module
        enter_device(self.device)
        return module.to(self.device)  # type: ignore[attr-defined]


RunnerFactory = Callable[[HfStage], Union[ArRunner, ChunkRunner]]


def build_hf_engine(
    stage_config: Any, model: str, make_runner: RunnerFactory, dtypes: Mapping[str, torch.dtype] = DTYPES
) -> StageEngine:
    """The stage's engine on the runner `make_runner` builds. `dtypes`: the engine_args.dtype
    values the model runs (a value outside them is refused, naming the choices)."""
    args = stage_config.engine_args
    if args.dtype not in dtypes:
        raise ValueError(
            f"stage {stage_config.stage_id}: the hf engine of {args.model_stage!r} runs dtype "
            f"{', '.join(sorted(dtypes))}, not {args.dtype!r}; set engine_args.dtype to one of them"
        )
    dtype = dtypes[args.dtype]
    device = stage_device(stage_config)  # raises, naming the stage, where its GPU is not visible
    check_dtype(device, dtype, stage_config.stage_id)
    # The C kernels read host memory and compute float32: torch's kernels stand in on the GPU
    # and in other dtypes (logged once).
    kernels = kernels_for(device, args.attention_kernels, "attention", stage_config.stage_id, dtype)
    began = time.perf_counter()
    runner = make_runner(HfStage(stage_config, model, device, dtype, kernels))
    engine: StageEngine
    if isinstance(runner, ChunkRunner):
        engine = ChunkedEngine(
            stage_config.stage_id,
            runner,
            initial_chunk_frames=args.initial_codec_chunk_frames,
            chunk_frames=args.codec_chunk_frames,
            left_context_frames=args.codec_left_context_frames,
        )
    else:
        engine = ar_engine(stage_config, runner)
    engine.device = device
    log.info(
        "stage %d: hf %s engine ready in %.1f s on %s (model %s, load_format %s)",
        stage_config.stage_id,
        args.model_stage,
        time.perf_counter() - began,
        device,
        model,
        args.load_format,
    )
    return engine
