"""The fault suite in push mode (issue 39): the prefill worker writes the prompt's KV into blocks
its decode worker reserved, chunk by chunk, and a peer dies in the middle of it. The prefill
worker stops itself (SIGSTOP, the `push_stop` fault hook, omni_pd/faults.py) once its first chunk's writes are
out, so each case kills a peer at a known point mid-push with no sleep in between; then the
request must be answered by the fallback (equal to the colocated pipeline), within the miss
window of the kill, counted by the breaker, with nothing left on any stage. The soak runs here
too, in push mode, in a short form.

One push pipeline for the module (the short windows of e2e/test_faults.py); prompts long enough
for several 32-token chunks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import yaml

from omni_pd.orchestrator.omni import Omni

from test_faults import (
    CI,
    DECODE,
    PREFILL,
    PROMPTS,
    RESTART_BOUND_S,
    WINDOW_S,
    _clean_counts,
    _fault_config,
    _kill,
    _pid,
    _report,
    _same_as_colocated,
    _wait_for,
    _wait_healthy,
    soak,
)

pytestmark = pytest.mark.slow
CHUNK_TOKENS = 32
FENCE_S = 2.0
# Several chunks each (the tiny tokenizer: about a token per character of these).
LONG = [
    "Tell me everything about the sea, its tides and its creatures. " * 3,
    "Describe the rain falling on a city at night, street by street. " * 3,
    "List the colours of a sunset over the hills and say why they change. " * 3,
]


def _push_config(tmp_path) -> str:
    """The fault suite's config with transfer_mode push on the decode stage and 32-token push
    chunks on the prefill stage."""
    config = yaml.safe_load(open(_fault_config(tmp_path)).read())
    stages = {s["stage_id"]: s["engine_args"] for s in config["stage_args"]}
    stages[PREFILL]["kv_transfer_config"]["kv_connector_extra_config"]["kv_push_chunk_tokens"] = CHUNK_TOKENS
    stages[DECODE]["kv_transfer_config"]["kv_connector_extra_config"]["transfer_mode"] = "push"
    # A reservation given up while its writer may still write (an aborted request, a prefill leg
    # past its window) is fenced for the decode stage's kv_lease_timeout_s: short here, so the
    # soak's fences end within its wait for the counts to return to zero.
    stages[DECODE]["kv_lease_timeout_s"] = FENCE_S
    path = tmp_path / "pd_faults_push.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with Omni(
        stage_configs_path=_push_config(tmp_path_factory.mktemp("faults_push")), request_timeout_s=60
    ) as omni:
        yield omni


@pytest.fixture(scope="module")
def reference():
    with Omni(stage_configs_path=CI / "qwen3_omni_tiny.yaml", request_timeout_s=60) as omni:
        outputs = omni.generate(LONG + PROMPTS)
    assert all(len(o.prompt_token_ids) > 2 * CHUNK_TOKENS for o in outputs[: len(LONG)])
    return {p: (o.token_ids, o.audio) for p, o in zip(LONG + PROMPTS, outputs)}


@pytest.fixture(autouse=True)
def healthy(pd):
    _wait_healthy(pd, RESTART_BOUND_S)
    yield
    _wait_healthy(pd, RESTART_BOUND_S)
    _wait_for(lambda: _clean_counts(pd), 10, "every per-request count to return to zero")


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def _stage_counts(omni, stage_id: int) -> dict[str, int]:
    """One stage's per-request counts, asked of that stage alone (a frozen peer cannot delay it)."""
    return omni.control(stage_id, "debug_state_counts")


def _start_and_stop_mid_push(pd, prompt: str):
    """Send `prompt` with the prefill worker set to stop itself after its first chunk's writes;
    returns the request's future and the stopped worker's pid once it has stopped."""
    pid = _pid(pd, PREFILL)
    pd.control(PREFILL, "arm_fault", fault="push_stop", after_chunks=1)
    future = asyncio.run_coroutine_threadsafe(pd.engine.generate(prompt), pd._loop)
    _wait_for(lambda: _stopped(pid), 10, "the prefill worker to stop itself mid-push")
    return future, pid


def test_push_works_before_the_faults(pd, reference):
    """The cases below start from a push that works (the positive control of the fallbacks)."""
    out = pd.generate(LONG[2])[0]
    assert out.metrics["kv_path"] == "push" and not out.metrics["kv_fallback"], out.metrics
    _same_as_colocated(out, reference[LONG[2]])


def test_decode_killed_mid_push_the_prefill_lets_its_writes_go(pd, reference):
    engine = pd.engine
    failures = engine.handoff_failures
    future, prefill_pid = _start_and_stop_mid_push(pd, LONG[0])
    _kill(pd, DECODE)  # the reservation's memory goes with it
    killed = time.monotonic()
    # Resumed once the orchestrator has seen the death, so that the fallback waits for the
    # restarted decode worker. (Resumed before that, the prefill's failed writes can send the
    # fallback to the dead worker first; the request then fails naming it, as any request in
    # flight on a killed worker does.)
    decode = pd.engine.clients[DECODE]
    _wait_for(lambda: decode.unavailable() is not None, 5, "the orchestrator to see the decode worker die")
    os.kill(prefill_pid, signal.SIGCONT)  # the prefill goes on writing into a dead peer
    _wait_for(lambda: engine.handoff_failures > failures, 10, "the handoff to fail")
    given_up = time.monotonic() - killed
    out = future.result(30)  # the fallback, on the restarted decode worker
    answered = time.monotonic() - killed
    assert out.metrics["kv_fallback"]
    _same_as_colocated(out, reference[LONG[0]])
    assert engine.handoff_failures == failures + 1
    assert given_up < WINDOW_S + 1.0, given_up
    # The prefill worker kept no lease and releases every write (its blocks once Mooncake ends them).
    _wait_for(lambda: not any(_stage_counts(pd, PREFILL).values()), 10, "the prefill to hold nothing")
    assert answered < RESTART_BOUND_S + 1.0
    _report("decode SIGKILL mid-push", handoff_failed_after_s=given_up, answered_after_s=answered)


def test_prefill_killed_mid_push_the_decode_frees_its_reservation(pd, reference):
    engine = pd.engine
    failures = engine.handoff_failures
    future, _ = _start_and_stop_mid_push(pd, LONG[1])
    assert _stage_counts(pd, DECODE)["push_reservations"] == 1  # the negative control
    _kill(pd, PREFILL)
    killed = time.monotonic()
    out = future.result(30)
    failover = time.monotonic() - killed
    assert out.metrics["kv_fallback"]
    _same_as_colocated(out, reference[LONG[1]])
    assert engine.handoff_failures == failures + 1
    assert failover < WINDOW_S + 1.0, failover  # the death is seen before the window runs out
    # The writer is gone: the reserved blocks are freed at once, not fenced.
    _wait_for(lambda: not any(_stage_counts(pd, DECODE).values()), 10, "the decode to hold nothing")
    _wait_healthy(pd, RESTART_BOUND_S)
    out = pd.generate(LONG[2])[0]  # the restarted prefill worker pushes again
    assert out.metrics["kv_path"] == "push" and not out.metrics["kv_fallback"], out.metrics
    _same_as_colocated(out, reference[LONG[2]])
    _report("prefill SIGKILL mid-push", answered_after_kill_s=failover)


def test_prefill_frozen_mid_push_is_a_bounded_fallback_and_its_fence_ends(pd, reference):
    """The prefill worker frozen (SIGSTOP) mid-push: the request is answered by the fallback
    within the window, counted by the breaker; the decode side keeps the reservation's blocks
    out of use while the writer may still write (fenced for kv_lease_timeout_s), and once the
    writer is resumed and the fence is over, neither side holds anything and the next request
    is pushed again."""
    engine = pd.engine
    failures = engine.handoff_failures
    future, pid = _start_and_stop_mid_push(pd, LONG[0])
    stopped = time.monotonic()
    try:
        _wait_for(lambda: engine.handoff_failures > failures, 10, "the handoff to fail")
        given_up = time.monotonic() - stopped
        out = future.result(30)  # the fallback: the decode worker prefills it itself
        answered = time.monotonic() - stopped
        assert out.metrics["kv_fallback"]
        _same_as_colocated(out, reference[LONG[0]])
        assert engine.handoff_failures == failures + 1
        assert given_up < WINDOW_S + 1.0, given_up
        assert _stage_counts(pd, DECODE)["push_reservations"] == 0  # given up: no live reservation
    finally:
        os.kill(pid, signal.SIGCONT)  # the writer goes on, past its wait: it stops writing
    _wait_for(lambda: not any(_stage_counts(pd, DECODE).values()), FENCE_S + 10, "the fence to end")
    _wait_for(lambda: not any(_stage_counts(pd, PREFILL).values()), 10, "the prefill to hold nothing")
    out = pd.generate(LONG[2])[0]
    assert out.metrics["kv_path"] == "push" and not out.metrics["kv_fallback"], out.metrics
    _same_as_colocated(out, reference[LONG[2]])
    _report("prefill SIGSTOP mid-push", handoff_failed_after_s=given_up, answered_after_s=answered)


def test_soak_in_push_mode(pd):
    """The soak's short form in push mode: 200 requests at concurrency 8, a quarter aborted, the
    prefill worker killed halfway; most are pushed, none fails, nothing is left behind."""
    paths = soak(pd, 200, "soak (push)", prompts=PROMPTS + LONG)
    _report("soak (push) answers by KV path", **{str(path): n for path, n in paths.items()})
    assert paths["push"] > 0 and set(paths) <= {"push", None}, paths
