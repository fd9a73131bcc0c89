"""Step costs fitted to a profile: what one prefill pass and one decode pass take.

The functional forms (each pass is one forward pass of the engine: `runner.prefill` over the
step's prompt chunks, `runner.decode` over its decoding requests):

    prefill_ms = a + b*N + c*A     N: new prompt tokens in the pass; A: attention pairs,
                                   sum over its chunks of t*(s + (t+1)/2) for t new tokens
                                   after s already cached (a whole prompt of T: T(T+1)/2)
    decode_ms  = a + b*B + c*S     B: requests in the pass; S: the positions they attend to,
                                   summed (each request's cached context)

`a` is what a pass costs whatever it holds (launch, the layers' fixed weights, the LM head's
read), `b` the per-token (per-request) work, `c` attention. They are fitted by least squares on
relative error (a 60 ms row counts as much as a 6 s one), with every coefficient kept >= 0 (a
pass never gets cheaper with more work): each subset of the three terms is fitted and the best
one with no negative coefficient wins. A profile whose rows cannot separate the three terms is
refused, naming the `bench roofline` flags that measure the rows it lacks.

The fit is an affine model of what the roofline says is piecewise (memory-bound at small batches,
compute-bound past the knee; a MoE layer reads more experts as a batch grows until it reads all):
within the profiled range it holds to the residuals it reports, outside it extrapolates, and the
planner says how many steps fell outside.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .errors import PlanError
from .profile import DECODE, PREFILL, Profile

PREFILL_FORM = "prefill_ms = a + b*N + c*A (N new tokens; A = sum t*(s + (t+1)/2), t new after s cached)"
DECODE_FORM = "decode_ms = a + b*B + c*S (B requests; S = their cached positions, summed)"
ROOFLINE_FLAGS = (
    "--stages thinker_prefill,thinker_decode --prefill-tokens 64,256,1024 --prefill-batches 1 "
    "--batches 1,4,8,16 --contexts 256,1024"
)
# What each form needs of the profile, and the roofline flags that measure it.
NEEDS = {
    PREFILL: (
        "thinker_prefill rows at 3 or more prompt lengths",
        "--prefill-tokens 64,256,1024 --prefill-batches 1",
    ),
    DECODE: (
        "thinker_decode rows at 2 or more batches and 2 or more contexts",
        "--batches 1,4,8,16 --contexts 256,1024",
    ),
}


@dataclass(frozen=True)
class Fit:
    """`coef` (a, b, c) of one form, its largest relative error over the rows it was fitted to,
    and the range of the rows' main variable (N or B) it was fitted over."""

    coef: tuple[float, float, float]
    max_rel_err: float
    lo: int
    hi: int

    def __call__(self, x1: float, x2: float) -> float:
        a, b, c = self.coef
        return a + b * x1 + c * x2


@dataclass(frozen=True)
class StepCosts:
    """One worker's step costs (ms) at one thread count, on one device."""

    prefill: Fit
    decode: Fit
    threads: int
    device: str
    source: str
    bandwidth: float | None = None  # bytes/s the host reads (for the KV copy), when measured
    layers: int = 1
    dtype: str = "float32"

    def prefill_ms(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One prefill pass over `chunks`, each (new tokens t, tokens cached before s)."""
        n = sum(t for t, _ in chunks)
        pairs = sum(t * (s + (t + 1) / 2) for t, s in chunks)
        return self.prefill(n, pairs)

    def decode_ms(self, batch: int, context: int) -> float:
        """One decode pass of `batch` requests attending to `context` cached positions in all."""
        return self.decode(batch, context)

    def scaled(self, speedup: float, threads: int) -> "StepCosts":
        """These costs on `threads` threads, assumed `speedup` times faster (--thread-speedup)."""

        def fit(f: Fit) -> Fit:
            return replace(f, coef=(f.coef[0] / speedup, f.coef[1] / speedup, f.coef[2] / speedup))

        return replace(
            self,
            prefill=fit(self.prefill),
            decode=fit(self.decode),
            threads=threads,
            source=f"{self.source} / {speedup:g} (--thread-speedup)",
        )


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> tuple[tuple[float, float, float], float]:
    """(a, b, c) minimising the relative squared error of `x @ coef` against `y`, every
    coefficient >= 0 (the best subset fit whose coefficients all are), and its largest
    relative error."""
    weights = 1.0 / y
    best: tuple[float, np.ndarray] | None = None
    for size in (3, 2, 1):
        for cols in itertools.combinations(range(3), size):
            sub = x[:, cols] * weights[:, None]
            solution, *_ = np.linalg.lstsq(sub, np.ones_like(y), rcond=None)
            if (solution < 0).any():
                continue
            coef = np.zeros(3)
            coef[list(cols)] = solution
            err = float(np.sum(((x @ coef) / y - 1.0) ** 2))
            if best is None or err < best[0] - 1e-12:
                best = (err, coef)
    assert best is not None, "a single term with a positive target always fits"
    coef = best[1]
    worst = float(np.max(np.abs((x @ coef) / y - 1.0)))
    return (float(coef[0]), float(coef[1]), float(coef[2])), worst


def _fit(x: np.ndarray, y: np.ndarray, main: np.ndarray, what: str, source: str) -> Fit:
    scale = np.where(x.max(axis=0, initial=0.0) > 0, x.max(axis=0, initial=0.0), 1.0)
    if len(y) < 3 or np.linalg.matrix_rank(x / scale) < 3:
        need, flags = NEEDS[what]
        raise PlanError(
            f"--profile {source}: the {what} fit needs {need} (it has {len(y)} rows); measure them with "
            f"`omni-pd bench roofline CKPT --stages thinker_prefill,thinker_decode {flags} --json PATH`"
        )
    if (y <= 0).any():
        raise PlanError(f"--profile {source}: a {what} row has step_ms <= 0")
    coef, worst = fit_nonnegative(x, y)
    return Fit(coef, worst, int(main.min()), int(main.max()))


def fit_costs(profile: Profile) -> StepCosts:
    """The prefill and decode fits of one profile (see the module's forms)."""
    pre = profile.stage(PREFILL)
    dec = profile.stage(DECODE)
    px = np.array(
        [[1.0, r.batch * r.tokens, r.batch * r.tokens * (r.context + (r.tokens + 1) / 2)] for r in pre]
    ).reshape(-1, 3)
    dx = np.array([[1.0, r.batch, r.batch * r.context] for r in dec]).reshape(-1, 3)
    prefill = _fit(
        px,
        np.array([r.step_ms for r in pre]),
        np.array([r.batch * r.tokens for r in pre] or [0]),
        PREFILL,
        profile.source,
    )
    decode = _fit(
        dx,
        np.array([r.step_ms for r in dec]),
        np.array([r.batch for r in dec] or [0]),
        DECODE,
        profile.source,
    )
    return StepCosts(
        prefill,
        decode,
        profile.threads,
        profile.device,
        profile.source,
        profile.bandwidth,
        profile.layers,
        profile.dtype,
    )
