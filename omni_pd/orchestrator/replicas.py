"""A stage's replicas, and how a request is routed to one of them.

Every replica is a `StageClient` of its own: its own worker, restarts, heartbeat. The pool picks
a replica for each request by load, never in turn:

1. only replicas that are up and answering (a restarting, frozen or down replica gets nothing new);
2. first those whose KV cache has room for the request (free blocks as the engine last reported
   them, with its heartbeat, against the request's prompt plus max_tokens), then
3. the fewest requests in flight there (routed by this orchestrator and not finished: exact and
   current, where the engine's own count is up to a heartbeat old), then
4. the fewest prompt tokens those requests still bring, then the lowest index.

A request's `Assignment` counts it on its replica from the pick until the stage is done with it;
the request's state owns it and releases it on every path (success, failure, abort).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Iterable

from .stage_client import StageClient, StageTimeout, StageUnavailable
from .supervisor import StageStatus

log = logging.getLogger(__name__)
WAKE_S = 0.5  # a silent replica that speaks again does not notify: look again this often


@dataclass
class Assignment:
    """One request placed on one replica of one stage."""

    pool: "StagePool"
    index: int
    tokens: int
    released: bool = False

    @property
    def client(self) -> StageClient:
        return self.pool.clients[self.index]

    def release(self) -> None:
        """The stage is done with the request (idempotent): it no longer counts as load."""
        if not self.released:
            self.released = True
            self.pool.in_flight[self.index] -= 1
            self.pool.queued_tokens[self.index] -= self.tokens


class StagePool:
    def __init__(self, stage_id: int, clients: Iterable[StageClient] = ()):
        self.stage_id = stage_id
        self.clients: list[StageClient] = []
        self.in_flight: list[int] = []
        self.queued_tokens: list[int] = []
        self.routed: list[int] = []  # requests ever routed to each replica (a Prometheus counter)
        for client in clients:
            self.add(client)

    def add(self, client: StageClient) -> None:
        self.clients.append(client)
        self.in_flight.append(0)
        self.queued_tokens.append(0)
        self.routed.append(0)

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def first(self) -> StageClient:
        return self.clients[0]

    def usable(self) -> list[int]:
        return [k for k, client in enumerate(self.clients) if client.unavailable() is None]

    def unavailable(self) -> StageUnavailable | None:
        """None when some replica can take a request; else why not (the first replica's reason,
        or each one's when there are several)."""
        answers = [client.unavailable() for client in self.clients]
        reasons = [r for r in answers if r is not None]
        if len(reasons) < len(answers):  # some replica answered None
            return None
        if len(reasons) == 1:
            return reasons[0]
        hints = [r.retry_after_s for r in reasons if r.retry_after_s is not None]
        return StageUnavailable("; ".join(str(r) for r in reasons), min(hints) if hints else None)

    def _room(self, index: int, positions: int) -> bool:
        load = self.clients[index].engine_load
        free, size = load.get("free_kv_blocks"), load.get("kv_block_size")
        return free is None or not size or -(-positions // size) <= free

    def ranked(self, tokens: int = 0, positions: int = 0, among: Iterable[int] | None = None) -> list[int]:
        """Replica indices, best first (see the module's rules); `among` defaults to the usable."""
        candidates = self.usable() if among is None else list(among)
        return sorted(
            candidates,
            key=lambda k: (not self._room(k, positions), self.in_flight[k], self.queued_tokens[k], k),
        )

    def assign(self, index: int, tokens: int = 0) -> Assignment:
        self.in_flight[index] += 1
        self.queued_tokens[index] += tokens
        self.routed[index] += 1
        return Assignment(self, index, tokens)

    def pick(self, tokens: int = 0, positions: int = 0) -> Assignment:
        """The best usable replica; with none usable, the best of all (the request then waits for
        it, or fails naming it, as with a single worker)."""
        ranked = self.ranked(tokens, positions) or self.ranked(tokens, positions, range(len(self.clients)))
        return self.assign(ranked[0], tokens)

    def describe_load(self, index: int) -> str:
        load = self.clients[index].engine_load
        kv = (
            f", {load['free_kv_blocks']}/{load['kv_blocks']} KV blocks free"
            if "free_kv_blocks" in load
            else ""
        )
        return f"{self.in_flight[index]} in flight, {self.queued_tokens[index]} prompt tokens queued{kv}"

    def load(self, index: int) -> dict[str, int]:
        return {
            "in_flight": self.in_flight[index],
            "queued_tokens": self.queued_tokens[index],
            "routed": self.routed[index],
            **self.clients[index].engine_load,
        }

    async def wait_usable(self, timeout_s: float) -> None:
        """Return once some replica is up and answering; wait while they restart or are silent
        (up to `timeout_s`, then StageTimeout); raise at once when every replica is down."""
        if len(self.clients) == 1:
            return await self.first.wait_usable(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            why = self.unavailable()
            if why is None:
                return
            if all(c.status in (StageStatus.DOWN, StageStatus.CLOSED) for c in self.clients):
                raise why
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StageTimeout(f"{why} (gave up waiting after {timeout_s:.1f} s, the request's deadline)")
            changes = [client.status_changed() for client in self.clients]
            await asyncio.wait(changes, timeout=min(remaining, WAKE_S), return_when=asyncio.FIRST_COMPLETED)
            for change in changes:
                change.cancel()
