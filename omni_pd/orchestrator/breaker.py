"""The circuit breaker of a P/D pair's KV handoff.

Closed: every request tries the remote prefill leg. After `threshold` consecutive failed or
exhausted handoffs it opens: requests skip the remote leg (the pair's fallback serves them) for
`cooldown_s`. Then it is half-open: one request probes the remote leg (only while the prefill
worker is up and answering); its success closes the breaker, its failure opens it again.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        threshold: int,
        cooldown_s: float,
        name: str = "P/D handoff",
        clock: Callable[[], float] = time.monotonic,
    ):
        if threshold < 1 or cooldown_s <= 0:
            raise ValueError(
                f"breaker threshold must be >= 1 and cooldown > 0, got {threshold}, {cooldown_s}"
            )
        self.threshold, self.cooldown_s, self.name, self._clock = threshold, cooldown_s, name, clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.probe_started: float | None = None
        self.times_opened = 0

    def allow(self, peer_ready: bool = True) -> bool:
        """Whether this request may try the remote leg. Half-open lets one probe through at a
        time; a probe that never reports back (its request was aborted) is replaced after a
        cooldown."""
        now = self._clock()
        if self.state is BreakerState.CLOSED:
            return True
        if not peer_ready or now - self.opened_at < self.cooldown_s:
            return False
        if self.probe_started is not None and now - self.probe_started < self.cooldown_s:
            return False
        if self.state is BreakerState.OPEN:
            log.info("%s breaker half-open: one request probes the prefill side", self.name)
        self.state, self.probe_started = BreakerState.HALF_OPEN, now
        return True

    def success(self) -> None:
        if self.state is not BreakerState.CLOSED:
            log.warning("%s breaker closed: the prefill side serves again", self.name)
        self.state, self.consecutive_failures, self.probe_started = BreakerState.CLOSED, 0, None

    def failure(self, why: str) -> None:
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self.consecutive_failures >= self.threshold
        ):
            if self.state is BreakerState.CLOSED:
                log.warning(
                    "%s breaker open after %d failed handoffs in a row (last: %s); requests "
                    "skip the prefill side for %.1f s",
                    self.name,
                    self.consecutive_failures,
                    why,
                    self.cooldown_s,
                )
            else:
                log.debug("%s breaker probe failed (%s); open again", self.name, why)
            self.state, self.opened_at, self.probe_started = BreakerState.OPEN, self._clock(), None
            self.times_opened += 1
