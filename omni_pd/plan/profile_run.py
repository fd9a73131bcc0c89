"""`omni-pd plan --profile-model DIR`: a short profile of the thinker's steps, measured here.

It times the rows the cost fit needs through `bench roofline`'s own `Bench` (the same runners,
attention and caches the engines use), at each thread count the layouts give a worker, with one
warm run and one timed run per row, and without the roofline's FLOP counting and full-size
bandwidth and GEMM-peak probes (they do not enter the plan). Threads are torch's intra-op
threads of this process, not pinned: for figures to report, pin the run (taskset) or profile
with `bench roofline` under `OMP_NUM_THREADS=N taskset -c ...` and pass `--profile`.
On the real-shape one-layer checkpoint it takes about a minute per thread count on this host's
cores.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from .errors import PlanError
from .profile import Profile, StepRow

# (prompts, tokens each) of the prefill rows: three lengths for the fit, and a pass of 2,048
# tokens as a P/D prefill leg batches waiting prompts.
PREFILL_ROWS = ((1, 64), (1, 256), (1, 1024), (2, 1024))
DECODE_BATCHES = (1, 4, 8, 16)
DECODE_CONTEXTS = (256, 1024)


def _quick_bench(checkpoint: str, device: str, dtype: str) -> Any:
    import torch

    from ..bench import roofline

    class QuickBench(roofline.Bench):
        """The roofline's bench with small probes and one timed run per row, no FLOP count."""

        def __init__(self) -> None:
            self.checkpoint, self.device = checkpoint, torch.device(device)
            self.dtype = roofline.DTYPES[dtype]
            native = self.device.type == "cpu" and self.dtype == torch.float32
            self.kernels = "native" if native else "torch"
            self.repeats = 1
            self.bandwidth = roofline.read_bandwidth(self.device, 1 << 28)
            self.peak = roofline.gemm_peak(self.device, self.dtype, 512)
            self.rows: list[Any] = []

        def _measure(self, step: Callable[[], Any]) -> tuple[float, int, int]:
            return self._time(step), 0, 0

    return QuickBench()


def profile_model(
    checkpoint: str, threads: list[int], device: str = "cpu", dtype: str = "float32"
) -> list[Profile]:
    """One profile per thread count in `threads`, measured on `checkpoint`."""
    if not Path(checkpoint).is_dir():
        raise PlanError(
            f"--profile-model {checkpoint}: not a checkpoint directory (write one with "
            "`omni-pd make-tiny-model DIR --size real --layers 1`)"
        )
    import torch

    before = torch.get_num_threads()
    profiles = []
    try:
        for count in sorted(set(threads)):
            torch.set_num_threads(count)
            print(f"profiling {checkpoint} with {count} thread(s)", file=sys.stderr, flush=True)
            bench = _quick_bench(checkpoint, device, dtype)
            with torch.no_grad():
                bench.thinker(
                    list(PREFILL_ROWS),
                    [(b, c) for c in DECODE_CONTEXTS for b in DECODE_BATCHES],
                )
            rows = tuple(StepRow(r.stage, r.batch, r.tokens, r.context, r.step_ms) for r in bench.rows)
            layers = bench.rows[0].layers if bench.rows else 1
            profiles.append(
                Profile(
                    f"{checkpoint} ({count} threads)", device, dtype, count, bench.bandwidth, layers, rows
                )
            )
    finally:
        torch.set_num_threads(before)
    return profiles


def save_profile(profile: Profile, path: str | Path) -> None:
    """`profile` as a roofline JSON (the rows the planner reads), for `--profile` next time."""
    from ..bench.report import run_metadata, write_json

    meta = run_metadata(
        sys.argv,
        device=profile.device,
        dtype=profile.dtype,
        bandwidth=profile.bandwidth,
        threads=profile.threads,
        written_by="omni-pd plan --profile-model",
    )
    rows = [
        {
            "stage": r.stage,
            "batch": r.batch,
            "tokens": r.tokens,
            "context": r.context,
            "layers": profile.layers,
            "step_ms": r.step_ms,
        }
        for r in profile.rows
    ]
    write_json(path, meta, rows)
