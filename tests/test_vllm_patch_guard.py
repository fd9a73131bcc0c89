"""The version guard of omni-pd's vLLM fixes (no vLLM needed: the version is faked)."""

from __future__ import annotations

import logging

import pytest

from omni_pd.engines.vllm.patches import _guard


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(_guard, "_results", {})


def _patch(calls, reason=None):
    def install():
        calls.append(1)
        return reason

    return _guard.Patch(name="demo", what="demo fix", supported=("0.32.0",), install=install)


def test_refuses_other_versions_with_a_clear_message_once(fresh, monkeypatch, caplog):
    monkeypatch.setattr(_guard, "vllm_version", lambda: "0.33.1")
    calls: list[int] = []
    patch = _patch(calls)
    with caplog.at_level(logging.ERROR, logger="vllm.omni_pd.patches"):
        first, second = patch.apply(), patch.apply()
    assert calls == []  # nothing patched
    assert first is second and first.status == "refused" and not first.ok
    assert "written for vLLM 0.32.0" in first.detail and "0.33.1" in first.detail
    assert len([r for r in caplog.records if "demo" in r.getMessage()]) == 1


def test_applies_on_supported_version_local_tag_ignored(fresh, monkeypatch):
    monkeypatch.setattr(_guard, "vllm_version", lambda: "0.32.0+cpu")
    calls: list[int] = []
    result = _patch(calls).apply()
    assert result.status == "applied" and result.ok and calls == [1]
    assert _patch(calls).apply() is result and calls == [1]  # idempotent


def test_not_needed_and_install_errors(fresh, monkeypatch):
    monkeypatch.setattr(_guard, "vllm_version", lambda: "0.32.0")
    assert _patch([], reason="fixed upstream").apply().status == "not_needed"
    monkeypatch.setattr(_guard, "_results", {})

    def broken():
        raise AttributeError("no such method")

    result = _guard.Patch(name="demo", what="x", supported=("0.32.0",), install=broken).apply()
    assert result.status == "refused" and "no such method" in result.detail
