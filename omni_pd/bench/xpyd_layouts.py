"""The layouts `omni-pd bench serve --xpyd` compares and the cores each thinker worker gets.

A layout is `xPyD` (x prefill and y decode thinker workers; its baseline is `colocated-{x+y}x`,
added for it) or `colocated-Nx` (N colocated thinker replicas; `colocated-1x` is one thinker on
all the cores with as many torch threads). Every layout gets the same cores, `--xpyd-cpus`
(default: every CPU this process may run on), shared evenly among its thinker workers in order:
prefill replicas first, then decode. 1P1D on CPUs 0-3 is prefill 0-1, decode 2-3; colocated-2x
is replica 0 on 0-1, replica 1 on 2-3; colocated-1x is one worker on 0-3 with 4 threads. The
talker and code2wav stay unpinned. `--xpyd-cpus none` pins nothing (workers Ray places on other
nodes, GPU stages): each layout then differs only in its replicas.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..config.cpus import CpuSet, format_cpulist, parse_cpulist

XPYD = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
COLOCATED = re.compile(r"^colocated-(\d+)x$", re.IGNORECASE)
LAYOUT_SYNTAX = "layouts such as 1P1D, 2P2D or colocated-1x"


@dataclass(frozen=True)
class Layout:
    prefill: int  # P/D: thinker workers of each leg; colocated: 0 and 0
    decode: int
    colocated: int  # colocated thinker replicas; 0 for P/D

    @property
    def label(self) -> str:
        return f"colocated-{self.colocated}x" if self.colocated else f"{self.prefill}P{self.decode}D"

    @property
    def workers(self) -> int:
        """Thinker workers, the ones the layout's CPUs are shared among."""
        return self.colocated or self.prefill + self.decode

    def replicas(self) -> dict[str, int]:
        """Thinker replicas by role: "prefill" and "decode", or "thinker" (colocated)."""
        return (
            {"thinker": self.colocated}
            if self.colocated
            else {"prefill": self.prefill, "decode": self.decode}
        )

    @property
    def baseline(self) -> Layout | None:
        """The colocated layout a P/D one is measured against: as many thinker workers."""
        return None if self.colocated else Layout(0, 0, self.workers)


def parse_layouts(text: str) -> list[Layout]:
    """`--xpyd`'s comma-separated layouts, in order."""
    layouts: list[Layout] = []
    for token in (p.strip() for p in text.split(",") if p.strip()):
        pd, colocated = XPYD.match(token), COLOCATED.match(token)
        if pd and min(int(pd[1]), int(pd[2])) >= 1:
            layouts.append(Layout(int(pd[1]), int(pd[2]), 0))
        elif colocated and int(colocated[1]) >= 1:
            layouts.append(Layout(0, 0, int(colocated[1])))
        else:
            raise SystemExit(f"error: --xpyd takes {LAYOUT_SYNTAX}, got {token!r}")
    return layouts


def bench_cpus(text: str | None) -> CpuSet | None:
    """`--xpyd-cpus`, or every CPU this process may run on; None for "none" (workers unpinned).
    CPUs outside this process's are refused, since the servers it starts inherit its affinity."""
    mine = os.sched_getaffinity(0)
    if text is None:
        return tuple(sorted(mine))
    if text.strip().lower() == "none":
        return None
    try:
        cpus = parse_cpulist(text)
    except ValueError as exc:
        raise SystemExit(f"error: --xpyd-cpus: {exc}") from None
    if missing := sorted(set(cpus) - mine):
        raise SystemExit(
            f"error: --xpyd-cpus names CPU(s) {format_cpulist(missing)}, which this process may not "
            f"run on (its affinity is {format_cpulist(mine)}); name CPUs within it"
        )
    return cpus


def share_cpus(cpus: CpuSet, layout: Layout) -> dict[str, list[CpuSet]]:
    """Each thinker worker's set by role ("prefill", "decode" or "thinker"), one per replica:
    `cpus` shared evenly in order. Refuses a count the workers do not divide."""
    workers, have = layout.workers, len(cpus)
    if have < workers:
        raise SystemExit(
            f"error: {layout.label} has {workers} thinker workers, but --xpyd-cpus gives "
            f"{have} CPU(s) ({format_cpulist(cpus)}): give at least one CPU per worker"
        )
    if have % workers:
        fits = format_cpulist(cpus[: have - have % workers])
        raise SystemExit(
            f"error: {layout.label}'s {workers} thinker workers do not share the {have} CPUs of "
            f"--xpyd-cpus ({format_cpulist(cpus)}) evenly: give a multiple of {workers}, e.g. "
            f"--xpyd-cpus {fits}"
        )
    share = have // workers
    sets = [cpus[k * share : (k + 1) * share] for k in range(workers)]
    out: dict[str, list[CpuSet]] = {}
    for role, count in layout.replicas().items():
        out[role], sets = sets[:count], sets[count:]
    return out


def runtime_cpus(sets: list[CpuSet]) -> str | list[str]:
    """How the generated YAML writes a stage's sets: one cpulist, or one per replica."""
    lists = [format_cpulist(s) for s in sets]
    return lists[0] if len(lists) == 1 else lists
