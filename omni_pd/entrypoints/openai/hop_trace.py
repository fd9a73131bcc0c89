"""`omni-pd serve --trace-hops`: a chat answer carries its request's timeline, from the moment
the server took the request to the moment its last chunk left, joined from the server's own
stamps and the orchestrator's and workers' (`metrics["timeline"]["hops"]`, hops.py).

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


class HopTrace:
    """One request's server-side stamps: taken, first chunk out, and the rest of its path from
    its output's metrics."""

    def __init__(self, received: float) -> None:
        self.stamps: dict[str, float] = {"request in": received}

    def hop(self, hop: str) -> None:
        self.stamps.setdefault(hop, time.perf_counter())

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
