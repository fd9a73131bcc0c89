"""The restart policy and the handoff breaker, on a fake clock."""

import pytest

from omni_pd.orchestrator.breaker import BreakerState, CircuitBreaker
from omni_pd.orchestrator.supervisor import RestartPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_restart_backoff_doubles_and_a_worker_dying_too_often_stays_down():
    policy = RestartPolicy(max_restarts=3, window_s=60, first_backoff_s=0.25, max_backoff_s=1.0)
    assert [policy.next_delay(t) for t in (0, 1, 2)] == [0.25, 0.5, 1.0]
    assert policy.next_delay(3) is None  # a 4th death within 60 s
    assert "4 deaths in 60 s" in policy.describe_limit()


def test_deaths_outside_the_window_are_forgotten():
    policy = RestartPolicy(max_restarts=1, window_s=10)
    assert policy.next_delay(0) is not None
    assert policy.next_delay(11) is not None  # the first death is out of the window
    assert policy.next_delay(12) is None


def test_max_restarts_zero_never_restarts():
    assert RestartPolicy(max_restarts=0, window_s=10).next_delay(0) is None


def test_breaker_opens_after_threshold_consecutive_failures():
    clock = Clock()
    breaker = CircuitBreaker(3, cooldown_s=5, clock=clock)
    breaker.failure("a")
    breaker.failure("b")
    breaker.success()  # not consecutive any more
    breaker.failure("c")
    breaker.failure("d")
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    breaker.failure("e")
    assert breaker.state is BreakerState.OPEN and not breaker.allow()


def test_half_open_lets_one_probe_through_and_its_outcome_decides():
    clock = Clock()
    breaker = CircuitBreaker(1, cooldown_s=5, clock=clock)
    breaker.failure("dead")
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.2
    assert not breaker.allow(peer_ready=False)  # the prefill worker is still down: no probe
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one probe at a time
    breaker.failure("still dead")
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now += 5.1
    assert breaker.allow()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and breaker.allow()


def test_a_probe_that_never_reports_is_replaced_after_a_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(1, cooldown_s=5, clock=clock)
    breaker.failure("dead")
    clock.now += 5
    assert breaker.allow()  # the probe's request is then aborted: no success, no failure
    clock.now += 4
    assert not breaker.allow()
    clock.now += 1
    assert breaker.allow()


def test_breaker_refuses_nonsense_settings():
    with pytest.raises(ValueError, match="threshold"):
        CircuitBreaker(0, 1)
