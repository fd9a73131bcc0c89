"""Hop stamps: when a request passed each point of its path (the API server, the orchestrator,
each worker, the KV transfer), so the next gap is found by reading a request's timeline rather
than by guessing.

A stamp is `time.perf_counter()`, which on Linux is CLOCK_MONOTONIC: one clock for every process
of a host, so the stamps of the server, the orchestrator and its local workers line up with no
clock exchange (a Ray worker on another node has its own clock; `Omni` leaves its stamps out).
Each side keeps its stamps in the metrics dict it already reports, under `at.<hop>`; only the
first pass of a hop counts (a request computed again after preemption keeps its first stamps).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

PREFIX = "at."


def stamp(metrics: dict[str, Any], hop: str, now: float | None = None) -> None:
    """Record that the request passed `hop` now (or at `now`), unless it already had."""
    metrics.setdefault(PREFIX + hop, time.perf_counter() if now is None else now)


def stamps(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The hop stamps among `metrics`: hop -> perf_counter seconds."""
    return {k[len(PREFIX) :]: float(v) for k, v in metrics.items() if k.startswith(PREFIX)}


def without_stamps(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if not k.startswith(PREFIX)}


def timeline(origin: float, hops: Iterable[tuple[str, str, float]]) -> list[dict[str, Any]]:
    """`(where, hop, stamp)` triples as rows in the order they happened, each with its time
    since `origin` and since the row before it, in ms."""
    rows: list[dict[str, Any]] = []
    previous = origin
    for where, hop, at in sorted(hops, key=lambda h: h[2]):
        rows.append(
            {
                "where": where,
                "hop": hop,
                "at_ms": round((at - origin) * 1e3, 3),
                "step_ms": round((at - previous) * 1e3, 3),
            }
        )
        previous = at
    return rows
