"""The test-only fault hook registry (omni_pd/faults.py): inert unless armed, one-shot when
armed, refused by name."""

from __future__ import annotations

import os
import signal

import pytest

from omni_pd import faults


def test_every_point_is_inert_unless_armed(monkeypatch):
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    for point in faults.POINTS:
        assert faults.take(point) is None
        assert faults.peek(point) is None
        assert not faults.armed(point)
        faults.hit(point, transfer_id="t")
    assert killed == []


def test_an_armed_point_strikes_once_and_only_there():
    faults.arm("kv.publish.flip", block_index=1, byte_offset=5)
    assert faults.armed("kv.publish.flip") and not faults.armed("vllm.pull.miss")
    assert faults.take("vllm.pull.miss") is None
    assert faults.peek("kv.publish.flip") == {"block_index": 1, "byte_offset": 5}
    assert faults.take("kv.publish.flip") == {"block_index": 1, "byte_offset": 5}
    assert faults.take("kv.publish.flip") is None  # one shot


def test_disarm_and_arming_leave_nothing_armed():
    with faults.arming("vllm.serve.refuse"):
        assert faults.armed("vllm.serve.refuse")
    assert not faults.armed("vllm.serve.refuse")
    faults.arm("vllm.pull.miss")
    faults.disarm()
    assert not faults.armed("vllm.pull.miss")


def test_unknown_points_and_faults_are_refused_by_name():
    with pytest.raises(ValueError, match="no fault hook point 'nope'"):
        faults.arm("nope")
    with pytest.raises(ValueError, match="no fault 'inject_kv_fault'"):
        faults.arm_fault("inject_kv_fault")
    with pytest.raises(ValueError, match="after_chunks must be at least 1"):
        faults.arm_fault("push_stop", after_chunks=0)


def test_the_push_stop_acts_after_its_chunks(monkeypatch):
    """The stop lives in the registry: the push leg only says a chunk was sent."""
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    faults.arm_fault("push_stop", after_chunks=2)
    faults.hit("kv.push.chunk_sent", transfer_id="t")
    assert killed == []
    faults.hit("kv.push.chunk_sent", transfer_id="t")
    assert killed == [(os.getpid(), signal.SIGSTOP)]
    faults.hit("kv.push.chunk_sent", transfer_id="t")  # disarmed once it acted
    assert len(killed) == 1
