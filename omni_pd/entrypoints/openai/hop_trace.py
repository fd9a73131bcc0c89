"""A chat request's stamps in the server: when it arrived (`RequestGuard` stamps the ASGI scope
before the body is read), when its prompt was prepared, when its first and last chunks left. They
time the server's TTFT metric as a client times it: from the request's arrival to its first
chunk (streamed), or to the orchestrator's first token (not streamed).

`omni-pd serve --trace-hops`: a chat answer also carries its request's whole timeline, from the
moment the server took the request to the moment its last chunk left, joined from the server's
own stamps and the orchestrator's and workers' (`metrics["timeline"]["hops"]`, hops.py).
Off by default. On, the last chunk of a stream (the one with the finish reason), or the
non-streamed `chat.completion`, has a top-level `omni_pd_timeline`: {"hops": [{where, hop,
at_ms, step_ms}, ...], "origin": the server's perf_counter when it took the request}, each
`at_ms` since then. A client on the same
host can put its own perf_counter stamps (CLOCK_MONOTONIC) beside them
(`scripts/hop_timeline.py` does)."""

from __future__ import annotations

import time
from typing import Any

from ... import hops

KEY = "omni_pd_timeline"
WHERE = "api server"
SCOPE_KEY = "omni_pd_received"  # the arrival stamp RequestGuard puts in the ASGI scope's state


def arrival(scope_state: Any) -> float:
    """When the server took the request (its scope's stamp), or now when nothing stamped it."""
    return getattr(scope_state, SCOPE_KEY, None) or time.perf_counter()


class HopTrace:
    """One request's server-side stamps: taken, first chunk out, and the rest of its path from
    its output's metrics."""

    def __init__(self, received: float, publish: bool = True) -> None:
        """`publish`: the answer carries the timeline (--trace-hops)."""
        self.stamps: dict[str, float] = {"request in": received}
        self.publish = publish

    def hop(self, hop: str) -> None:
        self.stamps.setdefault(hop, time.perf_counter())

    def ttft_ms(self, metrics: dict[str, Any]) -> float | None:
        """The request's TTFT since it arrived: to its first chunk's send when streamed, else
        to the orchestrator's first token (its metrics' ttft_ms, since the orchestrator took it)."""
        received = self.stamps["request in"]
        if "first chunk out" in self.stamps:
            return (self.stamps["first chunk out"] - received) * 1e3
        origin = (metrics.get("timeline") or {}).get("origin")
        if metrics.get("ttft_ms") is None or origin is None:
            return metrics.get("ttft_ms")
        return (origin - received) * 1e3 + metrics["ttft_ms"]

    def timeline(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The request's whole timeline since the server took it, this process's stamps and
        every one its output's metrics carry."""
        inner = metrics.get("timeline") or {}
        origin = inner.get("origin")
        found = [(WHERE, hop, at) for hop, at in self.stamps.items()]
        if origin is not None:
            found.extend(
                (row["where"], row["hop"], origin + row["at_ms"] / 1e3) for row in inner.get("hops", ())
            )
        origin = self.stamps["request in"]
        return {"origin": origin, "hops": hops.timeline(origin, found)}
