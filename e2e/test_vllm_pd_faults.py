"""Faults on an `engine: vllm` P/D pair (issue 39, item 4): a prefill worker frozen (SIGSTOP) or
killed after it has published the KV, while the decode engine reads it over vLLM's
MooncakeConnector. Each case asserts that the read ends within the pair's `kv_miss_window_s`,
that the failure counts toward the breaker and the request is answered by the fallback with the
pair's healthy answer (which e2e/test_vllm_pd.py shows equals the colocated engine's), and that
no per-request state is left on any stage afterwards (`/debug/state`).

The fault lands at a chosen moment: the test wraps the orchestrator's decode leg so the signal
reaches the prefill worker after its leg has returned and before the decode leg is sent.
`pytest e2e/test_vllm_pd_faults.py -s` prints the measured times.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from live_server import wait_for
from vllm_required import require_vllm

require_vllm()

from omni_pd import Omni, SamplingParams  # noqa: E402
from omni_pd.paths import STAGE_CONFIGS_DIR  # noqa: E402

pytestmark = pytest.mark.slow
PREFILL, DECODE = 0, 1
WINDOW_S = 1.0  # kv_miss_window_s in this suite's config
COOLDOWN_S = 1.0
LEASE_S = 5  # the prefill engine's kv_lease_timeout_s: how long unsent KV waits for its reader
SLACK_S = 1.0  # scheduling on a loaded 2-core machine
RESTART_BOUND_S = 120.0  # a vLLM worker starts in ~5-60 s here
PROMPTS = ["Hello", "abc", "The quick brown fox jumps over the lazy dog.", "Tell me about the sea. " * 6]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, seed=0)


def _fault_config(tmp_path) -> str:
    config = yaml.safe_load((STAGE_CONFIGS_DIR / "ci" / "qwen3_text_pd_vllm.yaml").read_text())
    for stage in config["stage_args"]:
        stage["engine_args"]["kv_transfer_config"]["kv_connector_extra_config"].update(
            kv_miss_window_s=WINDOW_S,
            kv_handoff_deadline_s=2 * WINDOW_S,
            kv_breaker_threshold=3,
            kv_breaker_cooldown_s=COOLDOWN_S,
        )
        stage["runtime"]["max_restarts"] = 100
        if stage["stage_id"] == PREFILL:
            stage["engine_args"]["kv_lease_timeout_s"] = LEASE_S
            # A frozen prefill worker is caught by the window and the breaker, not its heartbeat.
            stage["runtime"]["heartbeat_timeout_s"] = 60.0
    path = tmp_path / "vllm_pd_faults.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with Omni(
        stage_configs_path=_fault_config(tmp_path_factory.mktemp("faults")), request_timeout_s=60
    ) as omni:
        yield omni


@pytest.fixture(scope="module")
def reference(pd):
    """The pair's healthy answers: every prompt's KV came over the connector."""
    outputs = [pd.generate([p], [GREEDY], use_tqdm=False)[0] for p in PROMPTS]
    for out in outputs:
        assert not out.metrics["kv_fallback"] and out.metrics["num_cached_prompt_tokens"] > 0
    return {p: o.token_ids for p, o in zip(PROMPTS, outputs)}


@pytest.fixture(autouse=True)
def healthy(pd, reference):
    _wait_for(lambda: pd.health()["status"] == "ok", RESTART_BOUND_S, "every stage up")
    yield
    _wait_for(lambda: pd.health()["status"] == "ok", RESTART_BOUND_S, "every stage up")
    _wait_for(lambda: _clean(pd), LEASE_S + 10, "every per-request count to return to zero")


def _wait_for(condition, timeout_s: float, what: str):
    return wait_for(condition, timeout_s, what, poll_s=0.05)


def _clean(omni) -> bool:
    return all(v == 0 for v in omni.debug_state_counts().values())


def _prefill_pid(omni) -> int:
    return omni.engine.clients[PREFILL].process.pid


class _FaultAtDecodeLeg:
    """Sends `sig` to the prefill worker when the next decode leg with remote KV starts, and
    records when that was and when the orchestrator declared the handoff failed (and why)."""

    def __init__(self, omni, monkeypatch, sig: int) -> None:
        engine = omni.engine
        self.sent_at: float | None = None
        self.failed: list[tuple[float, str]] = []
        self.pid = _prefill_pid(omni)
        remote_decode, handoff_failed = engine.pd.remote_decode, engine.pd.handoff_failed

        async def fault_then_decode(*args, **kwargs):
            if self.sent_at is None:
                os.kill(self.pid, sig)
                self.sent_at = time.monotonic()
            return await remote_decode(*args, **kwargs)

        def record_failure(state, why):
            self.failed.append((time.monotonic(), why))
            return handoff_failed(state, why)

        monkeypatch.setattr(engine.pd, "remote_decode", fault_then_decode)
        monkeypatch.setattr(engine.pd, "handoff_failed", record_failure)

    def read_ended_after_s(self) -> float:
        assert self.sent_at is not None and self.failed, (self.sent_at, self.failed)
        return self.failed[0][0] - self.sent_at


def _one(omni, prompt):
    began = time.monotonic()
    out = omni.generate([prompt], [GREEDY], use_tqdm=False)[0]
    return out, time.monotonic() - began


def _report(case: str, **figures) -> None:
    print(f"\n[vllm faults] {case}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def test_prefill_frozen_during_the_kv_read(pd, reference, monkeypatch):
    """The decode engine's read from a frozen prefill engine ends at the window; two more
    requests miss the window on their prefill leg and open the breaker; the next one goes
    straight to the fallback. After SIGCONT the held blocks are settled and the pair hands
    KV over again once the breaker's probe succeeds."""
    engine = pd.engine
    failures_before = engine.handoff_failures
    fault = _FaultAtDecodeLeg(pd, monkeypatch, signal.SIGSTOP)
    try:
        out, took = _one(pd, PROMPTS[3])
        assert out.metrics["kv_fallback"] and out.token_ids == reference[PROMPTS[3]]
        read_s = fault.read_ended_after_s()
        assert "KVTransferFailed" in fault.failed[0][1] and "kv_wait_s" in fault.failed[0][1], fault.failed
        assert WINDOW_S * 0.9 <= read_s < WINDOW_S + SLACK_S, read_s
        for prompt in PROMPTS[:2]:  # the prefill leg itself now misses the window
            out, _ = _one(pd, prompt)
            assert out.metrics["kv_fallback"] and out.token_ids == reference[prompt]
        assert engine.handoff_failures - failures_before == 3
        assert engine.breaker.state.value == "open"
        out, open_took = _one(pd, PROMPTS[2])  # straight to the decode engine
        assert out.metrics["kv_fallback"] and out.token_ids == reference[PROMPTS[2]]
        assert open_took < WINDOW_S
        # Frozen: the decode engine still holds the aborted read's blocks (the prefill engine
        # may yet write into them), and says so.
        held = {k: v for k, v in pd.debug_state_counts().items() if k.startswith(f"stage{DECODE}.") and v}
        assert held == {f"stage{DECODE}.vllm.requests": 1}, held
    finally:
        os.kill(fault.pid, signal.SIGCONT)
    resumed = time.monotonic()
    monkeypatch.undo()
    _wait_for(lambda: _clean(pd), LEASE_S + 10, "every per-request count to return to zero")
    settled_s = time.monotonic() - resumed

    def remote_again():
        out = pd.generate([PROMPTS[1]], [GREEDY], use_tqdm=False)[0]
        assert out.token_ids == reference[PROMPTS[1]]
        return out if not out.metrics["kv_fallback"] else None

    out = _wait_for(remote_again, 10 * COOLDOWN_S, "the breaker to close after SIGCONT")
    assert engine.breaker.state.value == "closed" and out.metrics["num_cached_prompt_tokens"] > 0
    _report(
        "prefill SIGSTOP during the KV read",
        read_ended_after_s=round(read_s, 3),
        first_request_s=round(took, 3),
        failover_with_breaker_open_s=round(open_took, 3),
        state_zero_after_sigcont_s=round(settled_s, 3),
    )


def test_prefill_killed_during_the_kv_read(pd, reference, monkeypatch):
    """The read ends as soon as the decode side sees the prefill engine gone (at most the
    window), the decode engine frees the read's blocks at once, and the restarted prefill
    worker hands KV over again."""
    engine = pd.engine
    failures_before = engine.handoff_failures
    restarts_before = engine.clients[PREFILL].restarts
    fault = _FaultAtDecodeLeg(pd, monkeypatch, signal.SIGKILL)
    out, took = _one(pd, PROMPTS[3])
    assert out.metrics["kv_fallback"] and out.token_ids == reference[PROMPTS[3]]
    read_s = fault.read_ended_after_s()
    assert read_s < WINDOW_S + SLACK_S, read_s
    assert engine.handoff_failures == failures_before + 1 and "KVTransferFailed" in fault.failed[0][1]
    monkeypatch.undo()

    def decode_clean() -> bool:
        counts = pd.debug_state_counts()
        return all(v == 0 for k, v in counts.items() if not k.startswith(f"stage{PREFILL}."))

    _wait_for(decode_clean, 5.0, "the decode engine to free the failed read's blocks")
    decode_clean_s = time.monotonic() - fault.sent_at
    _wait_for(lambda: pd.health()["status"] == "ok", RESTART_BOUND_S, "the prefill worker to restart")
    back_s = time.monotonic() - fault.sent_at
    assert engine.clients[PREFILL].restarts == restarts_before + 1
    out, _ = _one(pd, PROMPTS[0])
    assert not out.metrics["kv_fallback"] and out.token_ids == reference[PROMPTS[0]]
    _report(
        "prefill SIGKILL during the KV read",
        read_ended_after_s=round(read_s, 3),
        request_s=round(took, 3),
        decode_state_zero_after_s=round(decode_clean_s, 3),
        prefill_back_after_s=round(back_s, 3),
    )
