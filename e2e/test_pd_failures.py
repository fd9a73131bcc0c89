"""P/D failure paths: every one ends in one clear error and leaves no state or lease behind."""
import os
import signal

import pytest

from omni_pd.orchestrator.omni import Omni
from omni_pd.orchestrator.stage_client import StageError
from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = pytest.mark.slow
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"


@pytest.fixture(scope="module")
def small_decode_pool(tmp_path_factory):
    # The decode engine can hold 4 blocks (64 tokens); the prefill engine 512.
    text = PD.read_text()
    head, tail = text.split("  - stage_id: 1\n", 1)
    tail = tail.replace("kv_pool_blocks: 512", "kv_pool_blocks: 4", 1)
    path = tmp_path_factory.mktemp("cfg") / "pd_small_decode_pool.yaml"
    path.write_text(head + "  - stage_id: 1\n" + tail)
    with Omni(stage_configs_path=path, request_timeout_s=60) as omni:
        yield omni


def _clean(omni):
    counts = omni.debug_state_counts()
    assert all(v == 0 for v in counts.values()), counts


def test_decode_failure_releases_the_prefill_lease_at_once(small_decode_pool):
    omni = small_decode_pool
    with pytest.raises(StageError) as err:
        omni.generate("y" * 200)  # ~210 tokens: 14 blocks, more than the decode pool holds
    message = str(err.value)
    assert "stage 1 (thinker)" in message and "kv_pool_blocks" in message
    _clean(omni)  # the lease went on the orchestrator's release, not on expiry
    assert omni.generate("ok")[0].token_ids  # and the pipeline keeps serving


def test_dead_decode_worker_is_a_bounded_error_not_a_hang(small_decode_pool):
    omni = small_decode_pool
    decode_pid = omni.clients[1].process.pid
    os.kill(decode_pid, signal.SIGKILL)
    omni.clients[1].process.join(10)
    with pytest.raises(StageError, match=r"stage 1 \(thinker\) worker .* exited"):
        omni.generate("hi")
    # The prefill side still answers and holds nothing for the failed request.
    counts = omni.clients[0].control("debug_state_counts")
    assert counts == {"thinker.requests": 0, "leases": 0, "used_blocks": 0}, counts
