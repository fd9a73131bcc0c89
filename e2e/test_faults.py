"""The fault-injection suite (issue 11): workers killed or frozen at chosen moments, a corrupted
KV block, aborts under load. Each case asserts the outcome (the P/D fallback's output equals the
colocated pipeline's, or a named error), an upper bound on time, that no per-request state is
left anywhere, and that the next requests are served.

Times are bounded generously for a loaded 2-core machine; the closing note of issue 11 has the
measured ones (`pytest e2e/test_faults.py -s` prints them).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import random
import signal
import time

import pytest
import torch
import yaml

from omni_pd.orchestrator.async_omni import AudioDelta, Finished, HandoffFailed, TextDelta
from omni_pd.orchestrator.omni import Omni
from omni_pd.orchestrator.stage_client import StageError
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

from live_server import wait_for

pytestmark = pytest.mark.slow
CI = STAGE_CONFIGS_DIR / "ci"
PREFILL, DECODE, TALKER, CODE2WAV = 0, 1, 2, 3
WINDOW_S = 0.5  # kv_miss_window_s in this suite's config
COOLDOWN_S = 1.0
RESTART_BOUND_S = 10.0  # the bar: a killed worker serves again within 10 s
PROMPTS = [
    "Hi",
    "Tell me about the sea.",
    "Count to five.",
    "What is rain?",
    "Name a colour.",
    "Say something kind.",
    "Why is the sky blue?",
    "A short poem.",
]


def _fault_config(tmp_path) -> str:
    """The tiny P/D config with a short miss window and breaker cooldown, and restarts without
    limit. The prefill worker's
    heartbeat timeout is long, so a frozen prefill worker is caught by the window and the
    breaker (the other stages keep the default)."""
    config = yaml.safe_load((CI / "qwen3_omni_tiny_pd.yaml").read_text())
    for stage in config["stage_args"]:
        kv = stage["engine_args"].get("kv_transfer_config")
        if kv is not None:
            kv["kv_connector_extra_config"].update(
                kv_miss_window_s=WINDOW_S,
                kv_handoff_deadline_s=2 * WINDOW_S,
                kv_breaker_threshold=3,
                kv_breaker_cooldown_s=COOLDOWN_S,
            )
        # This suite kills the prefill worker more often than a deployment should tolerate.
        stage["runtime"]["max_restarts"] = 100
        if stage["stage_id"] == PREFILL:
            stage["runtime"]["heartbeat_timeout_s"] = 30.0
    path = tmp_path / "pd_faults.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def colocated():
    with Omni(stage_configs_path=CI / "qwen3_omni_tiny.yaml", request_timeout_s=60) as omni:
        yield omni


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    path = _fault_config(tmp_path_factory.mktemp("faults"))
    with Omni(stage_configs_path=path, request_timeout_s=60) as omni:
        yield omni


@pytest.fixture(scope="module")
def reference(colocated):
    """The colocated pipeline's token ids and audio per prompt: what P/D must reproduce."""
    outputs = colocated.generate(PROMPTS)
    return {p: (o.token_ids, o.audio) for p, o in zip(PROMPTS, outputs)}


@pytest.fixture(autouse=True)
def healthy(pd):
    """Each case starts and ends with every stage up, the breaker closed and nothing held."""
    _wait_healthy(pd, RESTART_BOUND_S)
    yield
    _wait_healthy(pd, RESTART_BOUND_S)
    _wait_for(lambda: _clean_counts(pd), 10, "every per-request count to return to zero")


def _wait_for(condition, timeout_s: float, what: str):
    return wait_for(condition, timeout_s, what, poll_s=0.05)


def _wait_healthy(omni, timeout_s: float) -> float:
    began = time.monotonic()
    _wait_for(lambda: omni.health()["status"] == "ok", timeout_s, f"health ok: {omni.health()}")
    return time.monotonic() - began


def _clean_counts(omni) -> bool:
    return all(v == 0 for v in omni.debug_state_counts().values())


def _pid(omni, stage_id: int) -> int:
    return omni.engine.clients[stage_id].process.pid


def _kill(omni, stage_id: int, sig=signal.SIGKILL) -> int:
    pid = _pid(omni, stage_id)
    os.kill(pid, sig)
    return pid


def _same_as_colocated(output, expected) -> None:
    """`expected`: the colocated (token ids, audio) of the same prompt."""
    tokens, audio = expected
    assert output.token_ids == tokens
    assert output.audio is not None and torch.equal(output.audio, audio)


def _one(omni, prompt):
    began = time.monotonic()
    out = omni.generate(prompt)[0]
    return out, time.monotonic() - began


def _decode_start_ms(output) -> float:
    return output.metrics["timeline"]["stages"][str(DECODE)]["start_ms"]


def _report(case: str, **figures) -> None:
    print(
        f"\n[faults] {case}: "
        + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    )


def test_prefill_killed_between_requests_falls_back_then_restarts(pd, reference):
    _kill(pd, PREFILL)
    killed = time.monotonic()
    out, took = _one(pd, PROMPTS[0])
    assert out.metrics["kv_fallback"] and out.metrics["num_cached_prompt_tokens"] == 0
    _same_as_colocated(out, reference[PROMPTS[0]])
    assert took < 2.0
    _wait_healthy(pd, RESTART_BOUND_S)
    back = time.monotonic() - killed
    assert back < RESTART_BOUND_S
    assert pd.health()["stages"][str(PREFILL)]["restarts"] >= 1
    out, _ = _one(pd, PROMPTS[1])  # the restarted prefill worker serves the handoff again
    assert not out.metrics["kv_fallback"] and out.metrics["num_cached_prompt_tokens"] > 0
    _same_as_colocated(out, reference[PROMPTS[1]])
    _report(
        "prefill SIGKILL between requests",
        fallback_request_s=took,
        serving_again_s=time.monotonic() - killed,
        healthy_after_s=back,
    )


def test_prefill_killed_during_the_handoff_fails_over_at_once(pd, reference):
    os.kill(_pid(pd, PREFILL), signal.SIGSTOP)  # hold the request in its prefill leg
    future = asyncio.run_coroutine_threadsafe(pd.engine.generate(PROMPTS[2]), pd._loop)

    def in_prefill_leg():
        return any(PREFILL in s.active_stages for s in list(pd.engine._requests.values()))

    _wait_for(in_prefill_leg, 5, "the request to enter its prefill leg")
    _kill(pd, PREFILL)
    killed = time.monotonic()
    out = future.result(30)
    failover = time.monotonic() - killed
    assert out.metrics["kv_fallback"]
    _same_as_colocated(out, reference[PROMPTS[2]])
    assert failover < WINDOW_S + 1.0  # the death is seen before the window runs out
    _report("prefill SIGKILL during the handoff", answered_after_kill_s=failover)


def test_frozen_prefill_costs_one_window_per_request_until_the_breaker_opens(pd, reference):
    engine = pd.engine
    out, _ = _one(pd, PROMPTS[0])  # a handoff that works: the breaker counts failures in a row
    assert not out.metrics["kv_fallback"]
    failures_before = engine.handoff_failures
    pid = _kill(pd, PREFILL, signal.SIGSTOP)
    try:
        windows = []
        for prompt in PROMPTS[:3]:  # each exhausts the window; the third opens the breaker
            out, took = _one(pd, prompt)
            assert out.metrics["kv_fallback"]
            _same_as_colocated(out, reference[prompt])
            windows.append(_decode_start_ms(out) / 1e3)
        assert engine.breaker.state.value == "open"
        assert engine.handoff_failures - failures_before == 3
        assert all(WINDOW_S * 0.9 <= w < WINDOW_S + 1.0 for w in windows), windows
        out, _ = _one(pd, PROMPTS[3])  # the breaker is open: straight to the decode engine
        assert out.metrics["kv_fallback"]
        _same_as_colocated(out, reference[PROMPTS[3]])
        failover_ms = _decode_start_ms(out)
        assert failover_ms < 100
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()

    def remote_again():  # the half-open probe re-arms the breaker once the cooldown is over
        out = pd.generate(PROMPTS[4])[0]
        _same_as_colocated(out, reference[PROMPTS[4]])
        return out if not out.metrics["kv_fallback"] else None

    out = _wait_for(remote_again, 10 * COOLDOWN_S, "the breaker to close after SIGCONT")
    assert engine.breaker.state.value == "closed" and out.metrics["num_cached_prompt_tokens"] > 0
    _report(
        "prefill SIGSTOP then SIGCONT",
        windows_s=str([round(w, 3) for w in windows]),
        failover_after_open_ms=failover_ms,
        remote_again_after_resume_s=time.monotonic() - resumed,
    )


def test_corrupted_block_is_caught_and_served_by_the_fallback(pd, reference):
    failures_before = pd.engine.handoff_failures
    # Flipped after the checksums were taken, as if the bytes changed on the way.
    pd.control(PREFILL, "arm_fault", fault="kv_corruption", block_index=0, byte_offset=5, after_checksum=True)
    out, took = _one(pd, PROMPTS[5])
    assert out.metrics["kv_fallback"] and pd.engine.handoff_failures == failures_before + 1
    _same_as_colocated(out, reference[PROMPTS[5]])
    assert pd.engine.breaker.state.value == "closed"  # one failure does not open it
    out, _ = _one(pd, PROMPTS[5])
    assert not out.metrics["kv_fallback"]
    _report("one corrupted KV block", request_s=took)


def test_deadlines_hold_while_the_decode_worker_is_frozen(pd, reference):
    """Requests held by a frozen (SIGSTOPped) decode worker, and requests queued behind it, are
    answered by their deadline plus 1 s; the KV lease release never holds the answer."""
    deadline_s = 1.5
    engine = pd.engine
    engine.request_timeout_s = deadline_s
    pid = _kill(pd, DECODE, signal.SIGSTOP)
    try:

        async def timed(prompt: str, delay: float) -> float:
            await asyncio.sleep(delay)  # staggered arrivals: some queue behind the frozen worker
            began = time.monotonic()
            with pytest.raises(StageError) as err:
                await engine.generate(prompt)
            assert "deadline" in str(err.value) or "within" in str(err.value), str(err.value)
            return time.monotonic() - began

        async def all_of_them():
            return await asyncio.gather(*(timed(p, 0.4 * i) for i, p in enumerate(PROMPTS[:4])))

        answered = asyncio.run_coroutine_threadsafe(all_of_them(), pd._loop).result(60)
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.request_timeout_s = 60
    assert all(t < deadline_s + 1.0 for t in answered), answered
    out, _ = _one(pd, PROMPTS[0])
    _same_as_colocated(out, reference[PROMPTS[0]])
    _report("decode SIGSTOP, 1.5 s deadline", answered_s=str([round(t, 3) for t in answered]))


def test_incompatible_peers_are_refused_by_name_and_served_by_the_fallback(tmp_path, reference, caplog):
    """A prefill engine with other weights (seed 7) than its decode engine (seed 42): the first
    handoff compares fingerprints and refuses it naming the field; the decode engine computes
    the prompt itself, so the answer is still the colocated one."""
    config = yaml.safe_load(open(_fault_config(tmp_path)).read())
    config["stage_args"][PREFILL]["engine_args"]["seed"] = 7
    path = tmp_path / "pd_mismatch.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with Omni(stage_configs_path=path, request_timeout_s=60) as omni:
        out = omni.generate(PROMPTS[0])[0]
        assert out.metrics["kv_fallback"]
        _same_as_colocated(out, reference[PROMPTS[0]])
        assert omni.engine.handoff_failures == 1
        refusal = [r.getMessage() for r in caplog.records if "cannot hand KV on" in r.getMessage()]
        assert len(refusal) == 1 and "KVIncompatibleError" in refusal[0], refusal
        assert "weights" in refusal[0]  # the differing field, named
        # With kv_fallback 'error' the same failure is a named error instead.
        omni.engine.handoff = dataclasses.replace(omni.engine.handoff, fallback="error")
        with pytest.raises(HandoffFailed, match=r"KVIncompatibleError.*kv_fallback is 'error'"):
            omni.generate(PROMPTS[1])
        _wait_for(lambda: _clean_counts(omni), 10, "every per-request count to return to zero")


def _stream(omni, prompt, on_event=None, params=None, modalities=("text", "audio")):
    """Stream one request on the Omni's loop; `on_event(event)` runs for each event. Returns a
    future of (events, the exception that ended the stream or None)."""

    async def run():
        events, seen = omni.engine.stream(prompt, params, modalities=modalities), []
        try:
            async for event in events:
                seen.append(event)
                if on_event is not None:
                    on_event(event)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return seen, exc
        finally:
            await events.aclose()
        return seen, None

    return asyncio.run_coroutine_threadsafe(run(), omni._loop)


@pytest.mark.parametrize(
    "stage_id,name,wait_for_event",
    [
        (DECODE, "stage 1 (thinker)", TextDelta),
        (TALKER, "stage 2 (talker)", AudioDelta),
        (CODE2WAV, "stage 3 (code2wav)", AudioDelta),
    ],
)
def test_a_worker_killed_mid_stream_ends_the_stream_naming_it_and_comes_back(
    pd, reference, stage_id, name, wait_for_event
):
    killed: list[float] = []

    def kill_on_first(event):
        if isinstance(event, wait_for_event) and not killed:
            _kill(pd, stage_id)
            killed.append(time.monotonic())

    params = [SamplingParams(temperature=0, max_tokens=400, seed=42), None, None]
    if stage_id == DECODE:  # a long answer, so the kill lands mid-generation
        future = _stream(pd, "Go on and on.", kill_on_first, params, modalities=("text",))
    else:  # the talker runs to its max_tokens, so it is still at work at the first audio
        talker = pd.engine.stages[TALKER].default_sampling_params.replace(ignore_eos=True)
        future = _stream(pd, PROMPTS[6], kill_on_first, [None, talker, None])
    events, error = future.result(60)
    ended = time.monotonic() - killed[0]
    assert isinstance(error, StageError), error
    assert name in str(error) and "SIGKILL" in str(error), str(error)
    assert not any(isinstance(e, Finished) for e in events)
    assert ended < 2.0
    _wait_healthy(pd, RESTART_BOUND_S)
    back = time.monotonic() - killed[0]
    assert back < RESTART_BOUND_S
    out, _ = _one(pd, PROMPTS[6])
    _same_as_colocated(out, reference[PROMPTS[6]])
    _report(
        f"{name} SIGKILL mid-stream",
        error_after_s=ended,
        healthy_after_s=back,
        serving_again_s=time.monotonic() - killed[0],
    )


def test_eight_streams_while_the_prefill_worker_is_killed(pd, reference):
    killed: list[float] = []

    def kill_once(event):
        if isinstance(event, TextDelta) and not killed:
            _kill(pd, PREFILL)
            killed.append(time.monotonic())

    began = time.monotonic()
    futures = [_stream(pd, p, kill_once) for p in PROMPTS]
    results = [f.result(60) for f in futures]
    took = time.monotonic() - began
    for prompt, (events, error) in zip(PROMPTS, results):
        assert error is None, error
        out = events[-1].output
        _same_as_colocated(out, reference[prompt])
        streamed = torch.cat([e.audio for e in events if isinstance(e, AudioDelta)])
        assert torch.equal(streamed, out.audio)
    fallbacks = sum(r[0][-1].output.metrics["kv_fallback"] for r in results)
    _report("8 streams, prefill SIGKILLed", total_s=took, fallbacks=fallbacks)
    assert took < 30


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_soak_with_aborts_and_a_worker_kill(pd):
    """1000 requests at concurrency 8, a quarter aborted at a random moment, the prefill worker
    killed halfway: every request that was not aborted is answered, nothing is left behind, and
    no worker grew by more than 10%."""
    soak(pd, 1000, "soak")


def soak(pd, total: int, case: str, prompts=PROMPTS) -> collections.Counter:
    """The soak's body (e2e/test_faults_push.py runs it in push mode): `total` requests at
    concurrency 8, a quarter aborted at a random moment, the prefill worker killed halfway.
    Returns how many answered requests took each KV path (`kv_path`; None: the fallback)."""
    concurrency = 8
    rng = random.Random(1234)
    plan = [
        (prompts[i % len(prompts)], rng.random() < 0.25, rng.random() < 0.25, rng.uniform(0.0, 0.1))
        for i in range(total)
    ]
    pd.generate(list(prompts[:4]))  # warm every stage before the baseline
    baseline = {sid: _rss_kib(_pid(pd, sid)) for sid in (PREFILL, DECODE, TALKER, CODE2WAV)}
    engine = pd.engine
    restarts_before = engine.clients[PREFILL].restarts
    outcome = {"ok": 0, "aborted": 0, "failed": 0}
    paths: collections.Counter = collections.Counter()

    async def one(index: int, prompt: str, abort: bool, audio: bool, delay: float) -> None:
        request_id = f"soak-{index}"
        modalities = ("text", "audio") if audio else ("text",)
        task = asyncio.ensure_future(engine.generate(prompt, request_id=request_id, modalities=modalities))
        if abort:
            await asyncio.wait([task], timeout=delay)
            engine.abort(request_id)
        try:
            out = await task
            outcome["ok"] += 1
            paths[None if out.metrics["kv_fallback"] else out.metrics.get("kv_path")] += 1
        except Exception as exc:  # noqa: BLE001 - counted below
            outcome["aborted" if abort else "failed"] += 1
            if not abort:
                print("soak failure:", exc)

    async def run() -> None:
        queue = asyncio.Queue()
        for index, item in enumerate(plan):
            queue.put_nowait((index, *item))

        async def worker() -> None:
            while not queue.empty():
                index, prompt, abort, audio, delay = queue.get_nowait()
                if index == total // 2:
                    os.kill(_pid(pd, PREFILL), signal.SIGKILL)
                await one(index, prompt, abort, audio, delay)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    began = time.monotonic()
    asyncio.run_coroutine_threadsafe(run(), pd._loop).result(900)
    took = time.monotonic() - began
    _wait_healthy(pd, RESTART_BOUND_S)
    try:
        _wait_for(lambda: _clean_counts(pd), 10, "every per-request count to return to zero")
    except AssertionError:
        print("left:", {k: v for k, v in pd.debug_state_counts().items() if v})
        raise
    grown = {sid: _rss_kib(_pid(pd, sid)) / baseline[sid] for sid in baseline}
    assert engine.clients[PREFILL].restarts == restarts_before + 1
    _report(
        case,
        requests=total,
        seconds=took,
        **outcome,
        fallbacks=engine.fallbacks,
        **{f"rss_ratio_stage{k}": v for k, v in grown.items()},
    )
    assert outcome["failed"] == 0
    assert all(ratio <= 1.10 for ratio in grown.values()), grown
    return paths
