"""When a dead stage worker is restarted, and when it is left down.

Pure policy, no processes: the stage client records each death here and gets back the delay
before the next start, or None when the worker died too often (`runtime.max_restarts` deaths in
`runtime.restart_window_s`) and must stay down until a person looks at it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 8.0


class StageStatus(str, enum.Enum):
    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"
    DOWN = "down"  # died too often: left down
    CLOSED = "closed"


@dataclass
class RestartPolicy:
    max_restarts: int
    window_s: float
    first_backoff_s: float = FIRST_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    deaths: deque[float] = field(default_factory=deque)

    @classmethod
    def of(cls, runtime) -> "RestartPolicy":
        return cls(runtime.max_restarts, runtime.restart_window_s)

    def next_delay(self, now: float) -> float | None:
        """Record a death at `now` (monotonic seconds): the delay before restarting, doubling
        with each death in the window, or None to leave the stage down."""
        self.deaths.append(now)
        while self.deaths and self.deaths[0] <= now - self.window_s:
            self.deaths.popleft()
        if len(self.deaths) > self.max_restarts:
            return None
        return min(self.first_backoff_s * 2 ** (len(self.deaths) - 1), self.max_backoff_s)

    def describe_limit(self) -> str:
        return (
            f"{len(self.deaths)} deaths in {self.window_s:g} s, over runtime.max_restarts "
            f"({self.max_restarts})"
        )
