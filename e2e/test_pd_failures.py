"""P/D failure paths: every one ends in one clear error and leaves no state or lease behind."""

import asyncio
import os
import signal

import pytest

from omni_pd.orchestrator.async_omni import AudioDelta, TextDelta
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


def _stage_of(omni, model_stage: str) -> int:
    return next(s.stage_id for s in omni.config.stages if s.model_stage == model_stage)


def _stream_until(omni, prompt, stop_after_audio: int):
    """Stream a request; close it after `stop_after_audio` audio deltas (0: read it all).
    Returns (audio deltas seen, the exception that ended the stream or None)."""

    async def run():
        seen, events = 0, omni.engine.stream(prompt)
        try:
            async for event in events:
                if isinstance(event, AudioDelta):
                    seen += 1
                    if seen == stop_after_audio:
                        break
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return seen, exc
        finally:
            await events.aclose()
        return seen, None

    return asyncio.run_coroutine_threadsafe(run(), omni._loop).result(120)


def test_client_gone_mid_stream_stops_every_stage(small_decode_pool):
    omni = small_decode_pool
    assert omni.config.async_chunk
    talker = _stage_of(omni, "talker")
    max_frames = omni.stages[talker].default_sampling_params.max_tokens
    rows_before = omni.control(talker, "batch_stats")["decode_rows"]
    seen, error = _stream_until(omni, "Hi", stop_after_audio=1)
    assert seen == 1 and error is None
    _clean(omni)  # talker and code2wav dropped it at once, and the KV lease is released
    # The talker stopped well before its last frame: it was aborted, not left to finish (13 of 63
    # frames on an idle machine; the margin is for a loaded one).
    assert omni.control(talker, "batch_stats")["decode_rows"] - rows_before < max_frames * 3 // 4
    assert omni.generate("ok")[0].audio.numel() > 0


def test_client_gone_after_the_first_token_frees_both_legs(small_decode_pool):
    """Issue 48, bad input: the client goes as soon as the first chunk (the prefill leg's token)
    has left, while the KV handoff runs. The decode leg is aborted (or never starts), the prefill
    leg's KV lease is released, and neither side holds anything; the pair serves the next
    request."""
    omni = small_decode_pool

    async def first_then_gone():
        events = omni.engine.stream("Hi there", modalities=["text"])
        try:
            return await events.__anext__()
        finally:
            await events.aclose()

    first = asyncio.run_coroutine_threadsafe(first_then_gone(), omni._loop).result(120)
    assert isinstance(first, TextDelta)
    _clean(omni)
    assert omni.generate("ok")[0].token_ids


def test_stage_failing_mid_stream_ends_the_stream_with_its_name(small_decode_pool):
    omni = small_decode_pool
    code2wav = _stage_of(omni, "code2wav")
    omni.control(code2wav, "arm_fault", fault="chunk_failure", after_chunks=1)
    seen, error = _stream_until(omni, "Hi", stop_after_audio=0)
    assert seen == 1  # the first chunk reached the client, then the stage failed
    assert isinstance(error, StageError)
    assert f"stage {code2wav} (code2wav)" in str(error) and "injected fault" in str(error)
    _clean(omni)  # the talker was stopped too
    assert omni.generate("ok")[0].audio.numel() > 0


def test_dead_decode_worker_is_restarted_and_serves_again(small_decode_pool):
    omni = small_decode_pool
    decode_pid = omni.clients[1].process.pid
    os.kill(decode_pid, signal.SIGKILL)
    omni.clients[1].process.join(10)
    # A request that comes while it restarts waits for it (within its deadline), then succeeds.
    out = omni.generate("hi")[0]
    assert out.token_ids and omni.clients[1].process.pid != decode_pid
    assert omni.health()["stages"]["1"]["restarts"] == 1
    _clean(omni)
