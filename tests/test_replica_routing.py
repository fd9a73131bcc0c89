"""The router's rules (orchestrator/replicas.py) on stand-in replicas, and the per-replica metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from omni_pd.entrypoints.openai.metrics import ServerMetrics
from omni_pd.orchestrator.replicas import StagePool
from omni_pd.orchestrator.stage_client import StageTimeout, StageUnavailable
from omni_pd.orchestrator.supervisor import StageStatus


class FakeReplica:
    def __init__(self, name: str, load: dict | None = None, up: bool = True):
        self.name, self.engine_load = name, load or {}
        self.status = StageStatus.UP if up else StageStatus.RESTARTING
        self._changes: list[asyncio.Future] = []

    def unavailable(self):
        if self.status is StageStatus.UP:
            return None
        return StageUnavailable(f"{self.name} is {self.status.value}", 1.0)

    def status_changed(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._changes.append(future)
        return future

    def set_status(self, status: StageStatus) -> None:
        self.status = status
        for future in self._changes:
            if not future.done():
                future.set_result(None)


def _pool(*replicas: FakeReplica) -> StagePool:
    return StagePool(0, replicas)  # type: ignore[arg-type]


def test_idle_replicas_take_the_lowest_index_every_time_not_in_turn():
    pool = _pool(FakeReplica("a"), FakeReplica("b"))
    picks = []
    for _ in range(3):
        assignment = pool.pick()
        picks.append(assignment.index)
        assignment.release()
    assert picks == [0, 0, 0]
    assert pool.routed == [3, 0]


def test_fewest_in_flight_then_fewest_queued_tokens():
    pool = _pool(FakeReplica("a"), FakeReplica("b"), FakeReplica("c"))
    first = pool.pick(tokens=500)
    second = pool.pick(tokens=10)
    third = pool.pick(tokens=10)
    assert [first.index, second.index, third.index] == [0, 1, 2]
    # All hold one request: the one with the fewest prompt tokens queued is next.
    assert pool.ranked() == [1, 2, 0]
    second.release()
    assert pool.ranked()[0] == 1
    assert pool.in_flight == [1, 0, 1] and pool.queued_tokens == [500, 0, 10]


def test_a_replica_without_kv_room_comes_last():
    full = {"free_kv_blocks": 2, "kv_blocks": 64, "kv_block_size": 16}
    roomy = {"free_kv_blocks": 40, "kv_blocks": 64, "kv_block_size": 16}
    pool = _pool(FakeReplica("a", full), FakeReplica("b", roomy))
    busy = pool.assign(1)  # b is busier, but a cannot hold 100 positions (7 blocks)
    assert pool.ranked(tokens=60, positions=100) == [1, 0]
    assert pool.ranked(tokens=10, positions=20) == [0, 1]  # 2 blocks fit in a
    busy.release()


def test_replicas_that_are_not_up_get_nothing_new():
    pool = _pool(FakeReplica("a", up=False), FakeReplica("b"))
    assert pool.ranked() == [1]
    assert pool.pick().index == 1
    assert pool.unavailable() is None
    pool.clients[1].status = StageStatus.DOWN
    # None is up: the pick still names one (the request waits for it or fails naming it) ...
    assert pool.pick().index in (0, 1)
    why = pool.unavailable()
    assert "a is restarting" in str(why) and "b is down" in str(why) and why.retry_after_s == 1.0


def test_a_release_counts_once():
    pool = _pool(FakeReplica("a"))
    assignment = pool.pick(tokens=7)
    assignment.release()
    assignment.release()
    assert pool.in_flight == [0] and pool.queued_tokens == [0]


def test_waiting_for_a_replica_ends_when_one_comes_up():
    async def scenario():
        a, b = FakeReplica("a", up=False), FakeReplica("b", up=False)
        pool = _pool(a, b)
        waiting = asyncio.create_task(pool.wait_usable(30))
        await asyncio.sleep(0)  # it is waiting now (no polling: the status change wakes it)
        assert not waiting.done()
        b.set_status(StageStatus.UP)
        await asyncio.wait_for(waiting, 5)
        assert pool.ranked() == [1]

    asyncio.run(scenario())


def test_waiting_gives_up_at_once_when_every_replica_is_down_and_at_the_deadline_otherwise():
    async def scenario():
        a, b = FakeReplica("a", up=False), FakeReplica("b", up=False)
        a.status = b.status = StageStatus.DOWN
        with pytest.raises(StageUnavailable, match="a is down; b is down"):
            await _pool(a, b).wait_usable(30)
        with pytest.raises(StageTimeout, match="gave up waiting"):
            await _pool(FakeReplica("c", up=False), FakeReplica("d", up=False)).wait_usable(0.05)

    asyncio.run(scenario())


def test_per_replica_metrics_follow_the_health_report():
    metrics = ServerMetrics()

    def report(routed, in_flight):
        return {
            "stages": {
                "0": {
                    "name": "thinker prefill",
                    "responsive": True,
                    "restarts": 0,
                    "replicas": [{"load": {"routed": r, "in_flight": f}} for r, f in zip(routed, in_flight)],
                }
            }
        }

    metrics.observe_health(report([3, 1], [2, 0]))
    metrics.observe_health(report([5, 1], [0, 1]))
    text = generate_latest(metrics.registry).decode()
    assert 'omni_pd_stage_requests_total{replica="0",stage="0",stage_name="thinker prefill"} 5.0' in text
    assert 'omni_pd_stage_requests_total{replica="1",stage="0",stage_name="thinker prefill"} 1.0' in text
    assert 'omni_pd_stage_load{replica="0",stage="0",stage_name="thinker prefill"} 0.0' in text
    assert 'omni_pd_stage_load{replica="1",stage="0",stage_name="thinker prefill"} 1.0' in text
