"""Measured step costs as `omni-pd bench roofline --json` writes them, read for the planner.

One file is one run: its `device` (cpu, cuda:N), `dtype`, `threads` (torch's intra-op threads
of that run; pin them with taskset and OMP_NUM_THREADS), the host's read `bandwidth` (bytes/s)
and `results`, a row per step: stage, batch, tokens, context, layers, step_ms. The planner reads
the `thinker_prefill` and `thinker_decode` rows; a GPU's file is read the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import PlanError

PREFILL, DECODE = "thinker_prefill", "thinker_decode"


@dataclass(frozen=True)
class StepRow:
    stage: str
    batch: int
    tokens: int
    context: int
    step_ms: float


@dataclass(frozen=True)
class Profile:
    source: str
    device: str
    dtype: str
    threads: int
    bandwidth: float | None  # bytes/s the host reads, measured in the same run
    layers: int
    rows: tuple[StepRow, ...]

    @property
    def gpu(self) -> bool:
        return not self.device.startswith("cpu")

    def stage(self, name: str) -> list[StepRow]:
        return [r for r in self.rows if r.stage == name]


def read_profile(path: str | Path) -> Profile:
    """The profile in `path`; a file that is not a roofline JSON is refused in one line."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"--profile {path}: cannot read a roofline JSON ({exc})") from None
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise PlanError(
            f"--profile {path}: no `results` list; give the file `omni-pd bench roofline ... --json PATH` wrote"
        )
    rows = []
    try:
        for r in results:
            if r.get("stage") in (PREFILL, DECODE):
                rows.append(
                    StepRow(
                        r["stage"], int(r["batch"]), int(r["tokens"]), int(r["context"]), float(r["step_ms"])
                    )
                )
        layers = {int(r["layers"]) for r in results if r.get("stage") in (PREFILL, DECODE)}
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(
            f"--profile {path}: a row lacks {exc} (batch, tokens, context, layers, step_ms)"
        ) from None
    if len(layers) > 1:
        raise PlanError(f"--profile {path}: rows of {sorted(layers)} layers; one checkpoint per profile")
    device = str(data.get("device") or "cpu")
    threads = data.get("threads")
    if not isinstance(threads, int) or threads < 1:
        raise PlanError(f"--profile {path}: no `threads` (write it with a current `omni-pd bench roofline`)")
    bandwidth = data.get("bandwidth")
    return Profile(
        str(path),
        device,
        str(data.get("dtype") or "float32"),
        threads,
        float(bandwidth) if isinstance(bandwidth, (int, float)) and bandwidth > 0 else None,
        layers.pop() if layers else 1,
        tuple(rows),
    )
