"""The decode engine's side of the KV handoff, in one process with real Mooncake (loopback tcp):
reads are polled across steps, bounded by a miss window (a frozen peer costs the window, not
Mooncake's 30 s, and no spinning core), abandoned reads keep their staging blocks quarantined
until Mooncake ends them, fingerprints refuse an incompatible peer, corrupted KV is refused, and
a request without remote KV is prefilled on the decode engine exactly as the colocated engine
would."""

import math
import multiprocessing
import os
import resource
import signal
import time

import pytest
import torch

torch.set_num_threads(1)

from omni_pd.config import load_pipeline_config  # noqa: E402
from omni_pd.models.qwen3_omni.hf.build import thinker_model  # noqa: E402
from omni_pd.engines.core.ar_engine import ArEngine  # noqa: E402
from omni_pd.engines.core.pd_legs import FETCH_FAST_POLL_S, FETCH_POLL_S, DecodeEngine, PrefillEngine  # noqa: E402
from omni_pd.engines.core.request import Phase  # noqa: E402
from omni_pd.models.qwen3_omni.hf.thinker_runner import ThinkerRunner  # noqa: E402
from omni_pd.models.qwen3_omni.records import ThinkerPrompt  # noqa: E402
from omni_pd.kv import BlockLayout, KVSender, MooncakeTransport  # noqa: E402
from omni_pd.kv.fingerprint import FINGERPRINT_KEY  # noqa: E402
from omni_pd.paths import STAGE_CONFIGS_DIR  # noqa: E402
from omni_pd.planning.pd import build_decode_sampling_params, build_prefill_sampling_params  # noqa: E402
from omni_pd.sampling import SamplingParams  # noqa: E402

COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
WINDOW_S, DEADLINE_S = 2.0, 4.0  # the decode stage's kv_miss_window_s / kv_handoff_deadline_s
TEXTS = ["hi", "tell me about the sea", "what is two plus two?", "bonjour"]


def _pd_stage(stage_id: int, **extra):
    stage = load_pipeline_config(PD).stage(stage_id)
    kv = stage.kv_transfer_config
    merged = {**kv.kv_connector_extra_config.model_dump(exclude_unset=True), **extra}
    kv = kv.model_copy(update={"kv_connector_extra_config": type(kv.kv_connector_extra_config)(**merged)})
    args = stage.engine_args.model_copy(update={"kv_transfer_config": kv})
    return stage.model_copy(update={"engine_args": args})


@pytest.fixture(scope="module")
def runner(tiny_model, tiny_tokenizer):
    return thinker_model(tiny_model, tiny_tokenizer)


@pytest.fixture(scope="module")
def colocated(runner):
    return ArEngine(load_pipeline_config(COLOCATED).stage(0), ThinkerRunner(runner))


@pytest.fixture(scope="module")
def prefill(runner):
    engine = PrefillEngine(_pd_stage(0), ThinkerRunner(runner))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def decode(runner):
    # Mooncake tcp (kv_same_host off): the path whose reads span steps; the same-host path has
    # a test of its own below.
    engine = DecodeEngine(
        _pd_stage(1, kv_miss_window_s=WINDOW_S, kv_handoff_deadline_s=DEADLINE_S, kv_same_host="off"),
        ThinkerRunner(runner),
    )
    yield engine
    engine.close()


@pytest.fixture
def clean(decode, prefill):
    yield
    # A failed read's blocks stay quarantined until Mooncake ends it: reclaim until then.
    deadline = time.monotonic() + 10
    while decode.debug_state_counts()["kv_quarantined_blocks"] and time.monotonic() < deadline:
        decode.housekeeping()
        time.sleep(0.01)  # polling a condition under a deadline
    assert decode.debug_state_counts() == {
        "thinker.requests": 0,
        "thinker.kv_blocks_in_use": 0,
        "transfers": 0,
        "used_blocks": 0,
        "kv_quarantined_blocks": 0,
        "push_reservations": 0,
        "push_fenced_blocks": 0,
        "kv.vllm_pulls": 0,
        "kv.vllm_staging_blocks_held": 0,
    }
    assert prefill.debug_state_counts() == {
        "thinker.requests": 0,
        "thinker.kv_blocks_in_use": 0,
        "leases": 0,
        "used_blocks": 0,
        "pushes": 0,
        "push_fenced_blocks": 0,
    }


def _prompts(tokenizer, texts=TEXTS):
    return [
        ThinkerPrompt(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]


def _params(i: int, max_tokens: int = 12) -> SamplingParams:
    return (
        SamplingParams(temperature=0, max_tokens=max_tokens)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, seed=100 + i)
    )


def _run(engine, requests, pause=False):
    """requests: [(id, prompt, params)] added at once with chunks; step until done. Returns
    {id: (output, error, chunks, deltas)}; `pause` sleeps step_delay_s between steps, as the
    worker waits for messages."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params, stream=True, chunks=True)
    results = {rid: [None, None, [], []] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            entry = results[out.request_id]
            entry[3].extend(out.new_token_ids)
            if out.chunk is not None:
                entry[2].append(out.chunk)
            if out.finished:
                entry[0], entry[1] = out.output, out.error
        if pause:
            time.sleep(engine.step_delay_s())
    return results


def _same_output(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and torch.equal(a.output_embeds, b.output_embeds)
        and torch.equal(a.output_hidden, b.output_hidden)
    )


def _same_chunks(xs, ys) -> bool:
    def same(a, b):
        return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

    return len(xs) == len(ys) and all(
        x.token_ids == y.token_ids
        and x.start == y.start
        and x.prompt_token_ids == y.prompt_token_ids
        and torch.equal(x.embeds, y.embeds)
        and same(x.prompt_embeds, y.prompt_embeds)
        and same(x.prompt_hidden, y.prompt_hidden)
        for x, y in zip(xs, ys)
    )


# -- D. local prefill on the decode engine ------------------------------------------------------


def test_local_prefill_equals_the_colocated_engine(decode, colocated, tiny_tokenizer, clean):
    prompts = _prompts(tiny_tokenizer)
    requests = [(f"r{i}", p, _params(i)) for i, p in enumerate(prompts)]
    ours, theirs = _run(decode, requests), _run(colocated, requests)
    for rid, _, _ in requests:
        (a, error_a, chunks_a, deltas_a), (b, error_b, chunks_b, deltas_b) = ours[rid], theirs[rid]
        assert error_a is None and error_b is None
        assert _same_output(a, b) and deltas_a == deltas_b == a.token_ids
        assert torch.equal(a.prompt_embeds, b.prompt_embeds) and torch.equal(a.prompt_hidden, b.prompt_hidden)
        assert a.num_cached_prompt_tokens == 0
        assert chunks_a[0].prompt_embeds is not None  # the prompt rows ride in the first chunk
        assert _same_chunks(chunks_a, chunks_b)
    # Negative controls: another sampling seed, or one prompt token changed, changes the output.
    reseeded = _run(decode, [("s", prompts[1], _params(1).replace(seed=999))])["s"][0]
    assert reseeded.token_ids != ours["r1"][0].token_ids
    perturbed = ThinkerPrompt(list(prompts[0].prompt_token_ids))
    perturbed.prompt_token_ids[-4] += 1
    changed = _run(decode, [("p", perturbed, _params(0))])["p"][0]
    assert not torch.equal(changed.prompt_hidden[-4:], ours["r0"][0].prompt_hidden[-4:])
    assert not _same_output(changed, ours["r0"][0])


def test_local_prefill_costs_its_prompt_in_the_token_budget(runner, tiny_tokenizer):
    prompt = _prompts(tiny_tokenizer, ["x" * 50])[0]
    stage = _pd_stage(1)
    budget = len(prompt.prompt_token_ids) - 1
    for chunked in (False, True):
        args = stage.engine_args.model_copy(
            update={"max_num_batched_tokens": budget, "enable_chunked_prefill": chunked}
        )
        engine = DecodeEngine(stage.model_copy(update={"engine_args": args}), ThinkerRunner(runner))
        try:
            if not chunked:
                with pytest.raises(ValueError, match="max_num_batched_tokens"):
                    engine.add_request("long", prompt, _params(0))
            else:  # over two steps (tests/test_chunked_prefill.py: equal to one)
                engine.generate("long", prompt, _params(0))
                assert engine.batch_stats()["partial_chunks"] == 1
                assert engine.batch_stats()["max_step_tokens"] <= budget
        finally:
            engine.close()


# -- B. the remote path: polled across steps, output equals the colocated engine ---------------


def _handoff(prefill, request_id, prompt, params):
    transfer_id = f"{request_id}-xfer"
    out = prefill.generate(request_id, prompt, build_prefill_sampling_params(params, transfer_id))
    return build_decode_sampling_params(params, out.kv_transfer_params, transfer_id), transfer_id


def test_remote_kv_is_polled_across_steps_and_equals_colocated(
    decode, prefill, colocated, tiny_tokenizer, clean
):
    prompts = _prompts(tiny_tokenizer)
    handed = [_handoff(prefill, f"h{i}", p, _params(i)) for i, p in enumerate(prompts)]
    assert all(FINGERPRINT_KEY in params.kv_transfer_params for params, _ in handed)
    for i, (params, _) in enumerate(handed):
        decode.add_request(f"h{i}", prompts[i], params)
    assert decode.step() == []  # admitted: reads submitted, nothing waited for
    assert {decode.scheduler.requests[f"h{i}"].phase for i in range(len(prompts))} == {Phase.FETCHING}
    # Nothing decodes: the worker may sleep, briefly while the reads are young.
    assert decode.step_delay_s() in (FETCH_FAST_POLL_S, FETCH_POLL_S)
    outputs = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            assert out.error is None, out.error
            if out.finished:
                outputs[out.request_id] = out.output
        time.sleep(decode.step_delay_s())
    for i, prompt in enumerate(prompts):
        mine = outputs[f"h{i}"]
        ref = colocated.generate(f"c{i}", prompt, _params(i))
        assert _same_output(mine, ref), TEXTS[i]
        assert mine.prompt_embeds is None and mine.num_cached_prompt_tokens == len(prompt.prompt_token_ids)
        assert mine.metrics["kv_bytes_transferred"] > 0
        assert mine.metrics["kv_path"] == "tcp"
    for _, transfer_id in handed:
        assert prefill.release_kv(transfer_id)
    assert decode.peers.is_verified(prefill.engine_id)
    # The prefill leg published blocks of its paged cache as they were, and the reads landed in
    # the decode leg's paged cache: one registered pool a side, no staging pool beside it.
    assert prefill.sender.pool is prefill.kv.cache.pool and decode.receiver.pool is decode.kv.cache.pool
    assert prefill.transport.registered_bytes == prefill.kv.cache.pool.nbytes
    assert decode.transport.registered_bytes == decode.kv.cache.pool.nbytes


def test_the_same_host_path_equals_colocated_and_answers_in_the_admitting_step(
    runner, prefill, colocated, tiny_tokenizer, clean
):
    """kv_same_host 'auto' (the default) with both engines on this host: the KV is copied out of
    the prefill's shared cache while the request is admitted, so its first token leaves in that
    same step; the outputs equal the colocated engine's."""
    shm = DecodeEngine(_pd_stage(1), ThinkerRunner(runner))
    try:
        prompt = _prompts(tiny_tokenizer)[1]
        params, transfer_id = _handoff(prefill, "shm0", prompt, _params(1))
        shm.add_request("shm0", prompt, params, stream=True)
        first = shm.step()
        assert [out.new_token_ids for out in first] == [[params.kv_transfer_params["first_token"]]]
        outputs = {}
        while shm.has_unfinished_requests():  # the rest of it
            for out in shm.step():
                if out.finished:
                    outputs["shm0"] = (out.output, out.error)
        mine, error = outputs["shm0"]
        assert error is None and mine.metrics["kv_path"] == "shm"
        assert _same_output(mine, colocated.generate("c-shm", prompt, _params(1)))
        assert prefill.release_kv(transfer_id)
        assert shm.debug_state_counts() == {
            "thinker.requests": 0,
            "thinker.kv_blocks_in_use": 0,
            "transfers": 0,
            "used_blocks": 0,
            "kv_quarantined_blocks": 0,
            "push_reservations": 0,
            "push_fenced_blocks": 0,
            "kv.vllm_pulls": 0,
            "kv.vllm_staging_blocks_held": 0,
        }
    finally:
        shm.close()


def test_corrupted_kv_is_refused_with_integrity_error(decode, prefill, tiny_tokenizer, clean):
    # A prompt neither side has cached: the decode side must fetch its first block.
    prompt = ThinkerPrompt(list(_prompts(tiny_tokenizer)[1].prompt_token_ids) + [42] * 20)
    prompt.prompt_token_ids[2] = 77
    params, transfer_id = _handoff(prefill, "bad", prompt, _params(0))
    block = params.kv_transfer_params["remote_block_ids"][0]
    prefill.sender.pool.block_view(block)[7] ^= 0xFF  # the sender's memory changed after publish
    result = _run(decode, [("bad", prompt, params)])["bad"]
    assert result[1].startswith("KVIntegrityError") and transfer_id in result[1]
    assert prefill.release_kv(transfer_id)
    # The block stays in the prefill's prefix cache, with the checksum it was named with: the
    # same prompt again fails the handoff too, where a fresh checksum of the changed memory
    # would let the corruption through.
    params, transfer_id = _handoff(prefill, "bad-again", prompt, _params(0))
    assert params.kv_transfer_params["remote_block_ids"][0] == block  # reused from the cache
    result = _run(decode, [("bad-again", prompt, params)])["bad-again"]
    assert result[1].startswith("KVIntegrityError")
    assert prefill.release_kv(transfer_id)
    prefill.sender.pool.block_view(block)[7] ^= 0xFF  # repaired for the tests after this one


# -- C. fingerprints ----------------------------------------------------------------------------


def test_fingerprints_are_logged_and_described(decode, prefill):
    for engine in (decode, prefill):
        fingerprint = engine.describe()[FINGERPRINT_KEY]
        assert fingerprint["engine_id"] == engine.engine_id
        assert fingerprint["weights"].startswith("full:")  # the tiny thinker is hashed whole
        assert fingerprint["num_layers"] == engine.layout.num_layers
    strip = lambda f: {k: v for k, v in f.items() if k != "engine_id"}  # noqa: E731
    assert strip(decode.fingerprint) == strip(prefill.fingerprint)


def test_incompatible_peer_is_refused_naming_the_fields(decode, prefill, tiny_tokenizer, clean):
    prompt = _prompts(tiny_tokenizer)[0]
    params, transfer_id = _handoff(prefill, "fp", prompt, _params(0))
    kv = params.kv_transfer_params
    forged = {**kv[FINGERPRINT_KEY], "weights": "full:0123", "head_dim": 999}
    bad = params.replace(
        kv_transfer_params={**kv, "remote_engine_id": "other-prefill", FINGERPRINT_KEY: forged}
    )
    error = _run(decode, [("fp", prompt, bad)])["fp"][1]
    assert error.startswith("KVIncompatibleError") and "other-prefill" in error
    assert "weights: prefill 'full:0123', decode '" in error and "head_dim: prefill 999, decode" in error
    assert not decode.peers.is_verified("other-prefill")
    missing = params.replace(
        kv_transfer_params={k: v for k, v in kv.items() if k != FINGERPRINT_KEY}
        | {"remote_engine_id": "old-prefill"}
    )
    assert "sent no kv_fingerprint" in _run(decode, [("fp", prompt, missing)])["fp"][1]
    assert prefill.release_kv(transfer_id)


# -- B. a frozen prefill peer -------------------------------------------------------------------


def _frozen_sender(conn, layout: dict) -> None:
    """A prefill peer holding a KVSender: publishes on request, then gets SIGSTOPped."""
    sender = KVSender(
        "prefill-frozen", BlockLayout.from_dict(layout), 64, MooncakeTransport(), lease_timeout_s=300.0
    )
    while (message := conn.recv()) != "bye":
        transfer_id, num_tokens = message
        kv = torch.randn(layout["num_layers"], 2, layout["num_kv_heads"], num_tokens, layout["head_dim"])
        conn.send(sender.publish(transfer_id, kv).to_params())
    sender.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


class FrozenPeer:
    def __init__(self, layout: dict):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_frozen_sender, args=(child, layout), daemon=True)
        self.process.start()

    def publish(self, transfer_id: str, num_tokens: int) -> dict:
        self.conn.send((transfer_id, num_tokens))
        assert self.conn.poll(60), "the peer did not publish"
        return self.conn.recv()

    def freeze(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)
        while _state(self.process.pid) != "T":  # the signal lands asynchronously
            time.sleep(0.001)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def close(self) -> None:
        self.thaw()
        self.conn.send("bye")
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def peer(decode):
    """A peer the decode engine has already read from (Mooncake's handshake is done)."""
    frozen = FrozenPeer(decode.layout.to_dict())
    params = _remote_params(decode, frozen.publish("t-warm", 20))
    assert _run(decode, [("warm", ThinkerPrompt(list(range(20))), params)])["warm"][1] is None
    yield frozen
    frozen.close()


def _remote_params(decode, descriptor: dict, **extra) -> SamplingParams:
    kv = {
        **descriptor,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "first_token": 1,
        "rope_deltas": 0,
        FINGERPRINT_KEY: {**decode.fingerprint, "engine_id": "prefill-frozen"},
        **extra,
    }
    return SamplingParams(temperature=0, max_tokens=4, kv_transfer_params=kv)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread: ours, torch's, Mooncake's
    return usage.ru_utime + usage.ru_stime


def _wait_for_quarantine_to_empty(decode, limit_s: float) -> float:
    began = time.monotonic()
    while decode.debug_state_counts()["kv_quarantined_blocks"]:
        assert time.monotonic() - began < limit_s, decode.debug_state_counts()
        decode.housekeeping()
        time.sleep(0.05)
    return time.monotonic() - began


def test_frozen_peer_costs_the_window_and_no_core(decode, colocated, peer, tiny_tokenizer, capsys, clean):
    prompt = ThinkerPrompt(list(range(100, 140)))
    params = _remote_params(decode, peer.publish("t-frozen", len(prompt.prompt_token_ids)))
    local_prompt = _prompts(tiny_tokenizer)[2]
    expected = colocated.generate("ref", local_prompt, _params(0, max_tokens=16))
    peer.freeze()
    try:
        began = time.monotonic()
        decode.add_request("frozen", prompt, params)  # no kv_wait_s: the stage's window
        decode.add_request("local", local_prompt, _params(0, max_tokens=16))
        outputs, marks = {}, {}
        while decode.has_unfinished_requests():
            for out in decode.step():
                if out.finished:
                    outputs[out.request_id] = out
                    marks[out.request_id] = (time.monotonic(), _cpu_s())
            time.sleep(decode.step_delay_s())  # as the worker: wait for messages that long
        # The other request decoded meanwhile, unchanged.
        assert outputs["local"].error is None and _same_output(outputs["local"].output, expected)
        assert marks["local"][0] - began < WINDOW_S / 2
        # The frozen one failed after the window, with a message that says what to check.
        error = outputs["frozen"].error
        waited = marks["frozen"][0] - began
        assert error.startswith("KVMissError") and "t-frozen" in error and peer_session(params) in error
        assert "kv_miss_window_s" in error and f"within {WINDOW_S:g} s" in error
        assert WINDOW_S <= waited < WINDOW_S + 0.5
        # While only the read was left, the process (Mooncake's threads included) idled.
        (t0, c0), (t1, c1) = marks["local"], marks["frozen"]
        cpu_share = (c1 - c0) / (t1 - t0)
        assert cpu_share < 0.25
        # Per-request state is gone; the staging blocks are not: Mooncake may still write them.
        counts = decode.debug_state_counts()
        quarantined = counts.pop("kv_quarantined_blocks")
        assert quarantined == 3 and all(v == 0 for v in counts.values()), counts
        # The peer stays frozen: Mooncake ends the read after its progress timeout, set from
        # kv_handoff_deadline_s when the deployer did not set MC_TCP_PROGRESS_TIMEOUT_SEC.
        progress_timeout = float(os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"])
        held = waited + _wait_for_quarantine_to_empty(decode, progress_timeout + 5)
        assert held < progress_timeout + 1.5
    finally:
        peer.thaw()
    with capsys.disabled():
        print(
            f"\n[frozen peer] KVMissError after {waited:.2f} s (window {WINDOW_S} s); CPU "
            f"{cpu_share:.1%} of wall while waiting; {quarantined} staging blocks quarantined "
            f"{held:.2f} s (MC_TCP_PROGRESS_TIMEOUT_SEC={progress_timeout:g})"
        )


def peer_session(params: SamplingParams) -> str:
    return params.kv_transfer_params["remote_session"]


def test_kv_wait_s_zero_is_a_wait_that_ran_out(decode, peer, clean):
    params = _remote_params(decode, peer.publish("t-zero", 20), kv_wait_s=0)
    peer.freeze()
    try:
        error = _run(decode, [("zero", ThinkerPrompt(list(range(400, 420))), params)], pause=True)["zero"][1]
        assert error.startswith("KVMissError") and "within 0 s" in error
    finally:
        peer.thaw()
    _wait_for_quarantine_to_empty(decode, 5)


def test_kv_wait_s_overrides_the_window_and_a_thawed_peer_serves_again(decode, peer, clean):
    prompt = ThinkerPrompt(list(range(200, 220)))
    params = _remote_params(decode, peer.publish("t-short", 20), kv_wait_s=0.5)
    peer.freeze()
    try:
        began = time.monotonic()
        error = _run(decode, [("short", prompt, params)], pause=True)["short"][1]
        waited = time.monotonic() - began
        assert error.startswith("KVMissError") and "within 0.5 s" in error and 0.5 <= waited < 1.0
    finally:
        peer.thaw()
    # Resumed, the peer answers the abandoned read (a late write into quarantined blocks) ...
    _wait_for_quarantine_to_empty(decode, 5)
    # ... and serves the next request.
    params = _remote_params(decode, peer.publish("t-after", 20))
    assert _run(decode, [("after", prompt, params)], pause=True)["after"][1] is None


def _submitted(decode, transfer_id: str) -> bool:
    return decode.receiver._transfers[transfer_id].read._stage == "submitted"


def test_abort_while_fetching_quarantines_the_staging_blocks(decode, peer, clean):
    prompt = ThinkerPrompt(list(range(300, 350)))
    params = _remote_params(decode, peer.publish("t-abort", 50), kv_wait_s=30.0)
    peer.freeze()
    try:
        decode.add_request("aborted", prompt, params)
        assert decode.step() == [] and decode.scheduler.requests["aborted"].phase is Phase.FETCHING
        while not _submitted(decode, "t-abort"):  # in Mooncake's hands (a warm peer: at once)
            time.sleep(0.001)
        decode.abort_request("aborted")
        counts = decode.debug_state_counts()
        assert counts.pop("kv_quarantined_blocks") == 4 and all(v == 0 for v in counts.values())
        assert decode.step_delay_s() == 0.0  # nothing held: the worker's idle wait applies
    finally:
        peer.thaw()
    assert _wait_for_quarantine_to_empty(decode, 5) < 5


def test_peer_frozen_before_first_contact(decode, clean, capsys):
    """Mooncake's first call to a peer handshakes synchronously, ~60 s on a frozen peer: the
    engine still fails the request after the window and idles, reads queued behind the
    handshake are withdrawn at once, and the one in the handshake stays quarantined until the
    peer resumes."""
    cold = FrozenPeer(decode.layout.to_dict())
    try:
        first = _remote_params(decode, cold.publish("t-cold-1", 20), kv_wait_s=1.0)
        second = _remote_params(decode, cold.publish("t-cold-2", 40), kv_wait_s=1.0)
        cold.freeze()
        prompts = [ThinkerPrompt(list(range(500, 520))), ThinkerPrompt(list(range(600, 640)))]  # not cached
        began, cpu_began = time.monotonic(), _cpu_s()
        results = _run(decode, [("c1", prompts[0], first), ("c2", prompts[1], second)], pause=True)
        waited, cpu_share = time.monotonic() - began, (_cpu_s() - cpu_began) / (time.monotonic() - began)
        assert all(results[r][1].startswith("KVMissError") for r in ("c1", "c2"))
        assert 1.0 <= waited < 1.5 and cpu_share < 0.25
        assert decode.debug_state_counts()["kv_quarantined_blocks"] == 2  # c1's; c2's withdrawn
        cold.thaw()
        thawed = _wait_for_quarantine_to_empty(decode, 10)
    finally:
        cold.close()
    with capsys.disabled():
        print(
            f"\n[peer frozen before first contact] KVMissError after {waited:.2f} s, CPU "
            f"{cpu_share:.1%}; the read in the handshake freed {thawed:.2f} s after SIGCONT"
        )


@pytest.mark.parametrize("value", [-1.0, "5", True, math.inf, math.nan])
def test_bad_kv_wait_s_is_refused_at_add(decode, value, clean):
    params = _remote_params(
        decode,
        {
            "transfer_id": "t-x",
            "remote_engine_id": "p",
            "remote_session": "127.0.0.1:1",
            "remote_block_ids": [0],
            "remote_base_address": 4096,
            "block_bytes": decode.layout.block_bytes,
            "num_tokens": 3,
            "kv_layout": decode.layout.to_dict(),
            "block_checksums": ["00"],
        },
        kv_wait_s=value,
    )
    with pytest.raises(ValueError, match="kv_wait_s"):
        decode.add_request("x", ThinkerPrompt([1, 2, 3]), params)
