"""The layouts the planner compares, and each worker's share of the cores.

`xPyD`: x prefill workers and y decode workers (P/D); `colocated-Nx`: N replicas that each
prefill and decode (the fair baseline: the same cores, chunked prefill). `--cpus C` cores in all
go to the workers in equal shares (one torch thread per core); with a GPU profile C counts GPUs,
one per worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import PlanError

XPYD = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
COLOCATED = re.compile(r"^colocated-(\d+)x$", re.IGNORECASE)
FORMS = "xPyD (e.g. 1P1D) or colocated-Nx (e.g. colocated-2x)"


@dataclass(frozen=True)
class Layout:
    label: str
    prefill: int = 0  # P/D prefill workers
    decode: int = 0  # P/D decode workers
    replicas: int = 0  # colocated replicas

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def workers(self) -> int:
        return self.prefill + self.decode if self.disaggregated else self.replicas


def parse_layout(text: str, flag: str = "--layouts") -> Layout:
    name = text.strip()
    if match := XPYD.match(name):
        x, y = int(match[1]), int(match[2])
        if min(x, y) >= 1:
            return Layout(f"{x}P{y}D", prefill=x, decode=y)
    elif match := COLOCATED.match(name):
        if int(match[1]) >= 1:
            return Layout(f"colocated-{int(match[1])}x", replicas=int(match[1]))
    raise PlanError(f"{flag} takes {FORMS}, comma-separated; got {text!r}")


def parse_layouts(text: str) -> list[Layout]:
    layouts = [parse_layout(part) for part in text.split(",") if part.strip()]
    if not layouts:
        raise PlanError(f"--layouts takes {FORMS}, comma-separated; got {text!r}")
    return list(dict.fromkeys(layouts))


def threads_per_worker(layout: Layout, cpus: int) -> int:
    """Each worker's cores (threads) when `cpus` are shared equally; refused when there are more
    workers than cores or the cores do not divide evenly."""
    if layout.workers > cpus:
        raise PlanError(
            f"--layouts {layout.label} has {layout.workers} workers but --cpus is {cpus}: every worker "
            f"needs a core of its own; raise --cpus or drop {layout.label}"
        )
    if cpus % layout.workers:
        raise PlanError(
            f"--cpus {cpus} does not divide among {layout.label}'s {layout.workers} workers; give a "
            f"multiple of {layout.workers}"
        )
    return cpus // layout.workers
