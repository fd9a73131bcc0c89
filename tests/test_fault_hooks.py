"""The test-only fault hook registry (omni_pd/faults.py): inert unless armed, one-shot when
armed, armed by name through a stage engine's control call, and no production class carries a
test hook of its own."""

from __future__ import annotations

import ast
import os
import signal
from pathlib import Path

import pytest

from omni_pd import faults

ROOT = Path(__file__).resolve().parents[1] / "omni_pd"


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


def test_named_faults_arm_their_points_through_a_stage_control_call():
    from omni_pd.engines.base import StageEngine

    class Engine(StageEngine):  # the smallest engine: control() is what is under test
        stage_id = 0

        def add_request(self, *args, **kwargs):
            raise NotImplementedError

        def abort_request(self, *args, **kwargs):
            raise NotImplementedError

        def has_unfinished_requests(self):
            return False

        def step(self):
            return []

    engine = Engine.__new__(Engine)
    engine.control("arm_fault", fault="kv_corruption", block_index=2, byte_offset=7, after_checksum=True)
    assert faults.take("kv.publish.flip") == {"block_index": 2, "byte_offset": 7, "after_checksum": True}
    assert faults.take("prefill.uncacheable") == {}
    for name in ("vllm_serve_refusal", "vllm_pull_miss"):
        engine.control("arm_fault", fault=name)
    assert faults.armed("vllm.serve.refuse") and faults.armed("vllm.pull.miss")


def test_no_production_class_carries_a_test_hook_method():
    """No `inject_*` method, and no process signalling itself, outside the registry."""
    found = []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("inject_"):
                found.append(f"{path.relative_to(ROOT)}: def {node.name}")
        if path.name != "faults.py" and "signal.SIGSTOP" in path.read_text():
            found.append(f"{path.relative_to(ROOT)}: SIGSTOP")
    assert found == []
