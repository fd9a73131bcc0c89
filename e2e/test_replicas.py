"""Stage replicas (2P2D): each request is routed to a prefill and a decode replica by load, the
decode replica pulls the KV from the prefill replica that computed it, and the outputs equal the
colocated pipeline's byte for byte whichever replicas serve them. A replica that is down leaves
the others serving."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import STAGE_CONFIGS_DIR

from live_server import wait_for
from test_pd_equivalence import CASES, _prompts, alone, colocated, colocated_config, differences  # noqa: F401

pytestmark = pytest.mark.slow
TWO_BY_TWO = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_2p2d.yaml"
PREFILL, DECODE = 0, 1


@pytest.fixture(scope="module")
def pd22():
    with Omni(stage_configs_path=TWO_BY_TWO, keep_stage_outputs=True) as omni:
        yield omni


@pytest.fixture(autouse=True)
def nothing_left(pd22):
    yield
    wait_for(lambda: pd22.health()["status"] == "ok", 60, "every replica up again")
    counts = pd22.debug_state_counts()
    assert all(v == 0 for v in counts.values()), counts
    # Every replica of both thinker legs answered (none is missing from the counts).
    for tag in ("stage0.r0", "stage0.r1", "stage1.r0", "stage1.r1"):
        assert f"{tag}.thinker.requests" in counts, counts


def _replicas(out) -> tuple[int, int]:
    return out.metrics["replicas"][str(PREFILL)], out.metrics["replicas"][str(DECODE)]


def _handed_over(out) -> bool:
    """The KV of every prompt position came from the prefill replica (no local fallback)."""
    return not out.metrics["kv_fallback"] and out.metrics["num_cached_prompt_tokens"] == len(
        out.prompt_token_ids
    )


def test_the_equivalence_prompts_at_once_on_2p2d_equal_colocated(colocated, pd22):
    got = pd22.generate([_prompts(pd22)[case] for case in CASES])
    for case, out in zip(CASES, got):
        assert differences(colocated, alone(colocated, "colocated", case), pd22, out) == [], case
        assert _handed_over(out), (case, out.metrics)
    # Six requests at once spread over both replicas of each leg.
    assert {_replicas(o)[0] for o in got} == {0, 1}
    assert {_replicas(o)[1] for o in got} == {0, 1}


def test_routing_follows_load_and_crossed_links_hand_over_exactly(colocated, pd22):
    prompt = _prompts(pd22)["over_one_block"]
    want = alone(colocated, "colocated", "over_one_block")
    # Idle replicas: one request after another lands on the same replicas (round-robin would
    # alternate); the pick is by load.
    idle = [pd22.generate([prompt])[0] for _ in range(2)]
    assert [_replicas(o) for o in idle] == [(0, 0), (0, 0)]
    # Load prefill replica 0 and decode replica 1 with a held place each (as requests in flight
    # would): the next request goes to prefill 1 and decode 0, a crossed link, and back.
    pools = pd22.engine.pools
    for loaded, expected in (((0, 1), (1, 0)), ((1, 0), (0, 1))):
        holds = [pools[PREFILL].assign(loaded[0]), pools[DECODE].assign(loaded[1])]
        try:
            out = pd22.generate([prompt])[0]
        finally:
            for hold in holds:
                hold.release()
        assert _replicas(out) == expected
        assert _handed_over(out), out.metrics
        assert differences(colocated, want, pd22, out) == []


def test_negative_control_a_difference_on_one_replica_is_noticed(colocated, pd22):
    """The comparison above can fail: a flipped KV byte on prefill replica 1 shows in the
    output of a request routed there."""
    prompt = _prompts(pd22)["over_one_block"]
    want = alone(colocated, "colocated", "over_one_block")
    pools = pd22.engine.pools
    pd22.engine.pools[PREFILL].clients[1].control(
        "arm_fault", fault="kv_corruption", block_index=0, byte_offset=3
    )
    hold = pools[PREFILL].assign(0)
    try:
        corrupted = pd22.generate([prompt])[0]
    finally:
        hold.release()
    assert _replicas(corrupted)[0] == 1
    assert "talker input hidden states" in differences(colocated, want, pd22, corrupted)


@pytest.mark.parametrize("stage_id", [PREFILL, DECODE])
def test_a_killed_replica_leaves_the_other_serving(colocated, pd22, stage_id):
    prompt = _prompts(pd22)["short"]
    want = alone(colocated, "colocated", "short")
    victim = pd22.engine.pools[stage_id].clients[0]
    pid = victim.process.pid
    # Its restart waits until the requests below are served: a worker forked from the
    # preloading server is back within a second, and the point is what happens meanwhile.
    served, spawn = threading.Event(), victim._spawn

    def held_spawn():
        served.wait(60)
        return spawn()

    victim._spawn = held_spawn
    try:
        os.kill(pid, signal.SIGKILL)
        victim.process.join(10)
        # Replica 0 is dead (restarting): requests go to replica 1, and the KV still moves.
        outs = pd22.generate([prompt, prompt])
    finally:
        served.set()
        victim._spawn = spawn
    for out in outs:
        assert _replicas(out)[stage_id] == 1
        assert _handed_over(out), out.metrics
        assert differences(colocated, want, pd22, out) == []
    wait_for(
        lambda: victim.process.pid != pid and pd22.health()["status"] == "ok",
        60,
        "the killed replica to be restarted",
    )
    assert pd22.health()["stages"][str(stage_id)]["replicas"][0]["restarts"] >= 1
