"""The CPU sets of a stage's workers (`runtime.cpus`): how the YAML writes them, and which one a
worker takes.

A set is Linux's cpulist syntax ("0-3,6", as in /sys/devices/system/cpu/online and `taskset
-c`), a single CPU number, or a list of CPU numbers. `runtime.cpus` is one set (a stage with one
worker) or a list of sets, one per replica: `["0-1", "2-3"]` or `[[0, 1], [2, 3]]`. A list of
numbers is always one set, so `[0, 1]` never means two replicas of one CPU each; that is
`["0", "1"]`. The schema stores every form as a tuple of sets, one per replica.
"""

from __future__ import annotations

from typing import Any, Iterable

CpuSet = tuple[int, ...]  # sorted, no repeats, never empty
CPULIST_SYNTAX = 'a cpulist such as "0-3,6", a CPU number, or a list of CPU numbers'


def parse_cpulist(text: str) -> CpuSet:
    """ "0-3,6" -> (0, 1, 2, 3, 6). Raises ValueError naming the part it cannot read."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not low.strip().isdigit() or (sep and not high.strip().isdigit()):
            raise ValueError(f"cannot read {part!r} in cpulist {text!r}; use {CPULIST_SYNTAX}")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"range {part!r} in cpulist {text!r} runs backwards; write {last}-{first}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"cpulist {text!r} names no CPU; name at least one ({CPULIST_SYNTAX})")
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 6) -> "0-3,6", the form the kernel prints."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    start: int | None = None
    prev: int | None = None
    for cpu in [*ordered, None]:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(runs)


def _cpu_number(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a CPU number (a whole number from 0)")
    return value


def _one_set(value: Any) -> CpuSet:
    """A cpulist string, a CPU number, or a list of CPU numbers."""
    if isinstance(value, str):
        return parse_cpulist(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return (_cpu_number(value),)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"an empty list names no CPU; name at least one ({CPULIST_SYNTAX})")
        return tuple(sorted({_cpu_number(v) for v in value}))
    raise ValueError(f"expected {CPULIST_SYNTAX}, got {value!r}")


def _replica_set(k: int, value: Any) -> CpuSet:
    try:
        return _one_set(value)
    except ValueError as exc:
        raise ValueError(f"replica {k}'s set: {exc}") from None


def cpu_sets(value: Any) -> tuple[CpuSet, ...]:
    """The YAML's `runtime.cpus` as one set per replica. Raises ValueError saying what to write."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, list, tuple)) for v in value):
        return tuple(_replica_set(k, v) for k, v in enumerate(value))  # one set per replica
    if isinstance(value, (list, tuple)) and any(isinstance(v, (str, list, tuple)) for v in value):
        raise ValueError(
            f'{list(value)!r} mixes CPU numbers with sets: write one set ([0, 1] or "0-1") '
            'or one set per replica (["0", "1"] or [[0], [1]])'
        )
    return (_one_set(value),)


def worker_cpus(runtime: Any) -> CpuSet | None:
    """The CPUs of the worker a stage config describes (a replica's config holds its own set,
    `replicas.replica_configs`); None when it is not pinned."""
    sets = runtime.cpus
    if sets is None:
        return None
    if len(sets) != 1:
        raise ValueError(
            f"runtime.cpus holds {len(sets)} sets: a worker's config holds its own one "
            "(replica_configs shares them out)"
        )
    return sets[0]
