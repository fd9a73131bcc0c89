"""Admission control: how many requests the server serves at once, how many wait, and the 429
for the rest.

The stages admit at most `capacity` requests at a time: the smallest `max_num_seqs` x
`num_replicas` of the pipeline's stages, since every request passes through each of them. Requests beyond that wait in
a bounded FIFO queue. Once that queue is full, a request is refused at once with a 429, before
any work is done on it. A server that queues without bound only moves the overload into every
admitted request's latency.

Default queue: `DEFAULT_QUEUE_FACTOR` x capacity. With the stages full, a queued request waits
for at most that many batches to drain before it starts, so its latency stays within a small
multiple of a loaded request's. A client turned away sooner can retry, or go to another replica,
for less than that wait would cost it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Any

from .protocol import APIError

DEFAULT_QUEUE_FACTOR = 4
RETRY_AFTER_S = 1


class Slot:
    """One admitted request's place; released once, however its request ends."""

    def __init__(self, control: "AdmissionControl") -> None:
        self._control: AdmissionControl | None = control

    def release(self) -> None:
        control, self._control = self._control, None
        if control is not None:
            control._release()

    def release_with(self, owner: Any) -> None:
        """Also release when `owner` (a response body generator that may never start, if the
        client leaves first) is collected."""
        weakref.finalize(owner, self.release)


class AdmissionControl:
    def __init__(self, capacity: int, max_queued: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if max_queued < 0:
            raise ValueError(f"--max-queued-requests must be 0 or more, got {max_queued}")
        self.capacity = capacity
        self.max_queued = max_queued
        self.running = 0
        self._waiting: deque[asyncio.Future] = deque()
        self.rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def enter(self) -> Slot:
        """A slot now, a slot after waiting in line, or a 429 at once if the line is full."""
        if self.running < self.capacity and not self._waiting:
            self.running += 1
            return Slot(self)
        if len(self._waiting) >= self.max_queued:
            self.rejected += 1
            raise APIError(
                429,
                f"the server is overloaded: {self.running} requests are being "
                f"served and {len(self._waiting)} are waiting (at most "
                f"{self.max_queued}); retry after {RETRY_AFTER_S} s",
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn  # a released slot is handed over by _release, counted as running
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._release()  # handed a slot while being cancelled: pass it on
            else:
                self._waiting.remove(turn)
            raise
        return Slot(self)

    def _release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on; `running` stays as it is
                return
        self.running -= 1

    def counts(self) -> dict[str, int]:
        """Per-request state: zero when the server is idle."""
        return {"admission.running": self.running, "admission.queued": self.queued}
