"""An unmodified vLLM prefill engine's KV, read by omni-pd's hf side over vLLM's own
MooncakeConnector protocol (kv/vllm/pull.py), translated into the hf engine's fused blocks
(kv/vllm/layout.py) and named by vLLM's block keys.

The producer is the CI's vLLM thinker prefill leg (stage_configs/ci/qwen3_omni_tiny_vllm_pd.yaml,
the tiny Qwen3-Omni thinker on the hf stages' seeded weights) in its own process. The checks:
- the translated blocks hold the KV the hf thinker computes for the same prompt (bit for bit in
  layer 0, within float rounding after it; a perturbed value fails it: the negative control);
- an hf engine whose prefix cache is keyed by vLLM's hashes reuses those blocks and its greedy
  tokens equal the hf colocated ones and start with the vLLM prefill's first token;
- a second pull asking only for the blocks the decode side lacks moves exactly those (the
  producer sends the last ones: vLLM's partial prefix hit), the rest of staging untouched;
- incompatible geometries are refused by name, a missing transfer is bounded by the wait, and
  nothing is left held on either side.

Needs vLLM (`OMNI_PD_VLLM=1 bash scripts/setup.sh`); skipped without it outside CI.
"""

from __future__ import annotations

import dataclasses
import time
import re
import multiprocessing as mp
from pathlib import Path

import pytest

from vllm_required import require_vllm

require_vllm()

import torch  # noqa: E402

from omni_pd.kv.errors import KVIncompatibleError, KVMissError  # noqa: E402
from omni_pd.kv.layout import BlockLayout  # noqa: E402
from omni_pd.kv.transport import MooncakeTransport  # noqa: E402
from omni_pd.kv.vllm.block_hash import VllmBlockHasher  # noqa: E402
from omni_pd.kv.vllm.layout import VllmKVGeometry, check_geometry, translate_blocks  # noqa: E402
from omni_pd.config import load_pipeline_config  # noqa: E402
from omni_pd.engines.core.build import ar_engine  # noqa: E402
from omni_pd.engines.core.pd_legs import DecodeEngine  # noqa: E402
from omni_pd.kv.vllm.handoff import VLLM_KV_KEY, VllmProducerInfo  # noqa: E402
from omni_pd.kv.vllm.pull import VllmKVPuller  # noqa: E402
from omni_pd.models.qwen3_omni.hf.thinker_runner import ThinkerRunner  # noqa: E402
from omni_pd.planning import build_decode_sampling_params  # noqa: E402
from omni_pd.models.qwen3_omni.records import ThinkerPrompt  # noqa: E402
from omni_pd.sampling import SamplingParams  # noqa: E402

from test_thinker_engine import _engine, _run_together, _stage, runner  # noqa: E402, F401
from inproc_vllm_omni_thinker import LOGPROB_TOL  # noqa: E402
from vllm_kv_producer import serve  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
# The cross-engine pair: its stage 0 (vLLM, sha256_cbor block keys) is the producer, its stage 1
# (hf) the decode engine.
MIXED_CONFIG = REPO / "stage_configs/ci/qwen3_omni_tiny_vllm_p_hf_d.yaml"
PRODUCER_CONFIG = MIXED_CONFIG
BS = 32  # vLLM's CPU attention takes multiples of 32
PROMPT = [(11 * i + 7) % 200 + 20 for i in range(3 * BS + 5)]  # 3 full blocks and 5 tokens
SECOND = PROMPT[: 2 * BS] + [(5 * i + 3) % 200 + 20 for i in range(BS + 9)]  # shares 2 blocks
REPLY_S = 180


class Producer:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(str(PRODUCER_CONFIG), child), daemon=True)
        self.process.start()
        self._reply()

    def _reply(self):
        assert self.conn.poll(REPLY_S), "the vLLM producer did not answer"
        status, result = self.conn.recv()
        assert status == "ok", result
        return result

    def call(self, *command):
        self.conn.send(command)
        return self._reply()

    def close(self):
        self.call("close")
        self.process.join(30)


@pytest.fixture(scope="module")
def producer():
    p = Producer()
    yield p
    p.close()


@pytest.fixture(scope="module")
def geometry(producer) -> VllmKVGeometry:
    data = producer.call("geometry")
    geometry = VllmKVGeometry.from_dict(data)
    assert data["block_lens"] == [geometry.block_bytes] * geometry.num_layers
    return geometry


@pytest.fixture(scope="module")
def puller(geometry):
    transport = MooncakeTransport()
    p = VllmKVPuller(transport, geometry, staging_blocks=16)
    yield p
    p.close()


def _pull(producer, puller, request_id, ids, blocks=None, wait_s=30.0):
    first, params = producer.call("prefill", request_id, ids, f"{request_id}-xfer")
    assert params["omni_pd_kv_published"] is True
    worker = puller.worker_address(params["remote_bootstrap_addr"], params["remote_engine_id"], 10.0)
    count = -(-len(ids) // BS) if blocks is None else blocks
    pull = puller.start(params["transfer_id"], worker, count, wait_s)
    puller.wait(pull, wait_s + 5)
    assert puller.poll(pull)
    return first, pull


def _hf_kv(runner, ids):
    """The hf thinker's own KV for `ids`' full blocks ([blocks, bs, L, 2, H, hd]), its tokens."""
    engine = _engine(runner, kv_block_size=BS)
    [out], _ = _run_together(
        engine, [ThinkerPrompt(list(ids))], [SamplingParams(temperature=0, max_tokens=6)]
    )
    blocks = engine.kv.prefix.match(ids)
    kv = engine.kv.cache.data[blocks].clone()
    engine.kv.cache.release(blocks)
    return kv, out.token_ids


def test_vllm_blocks_translate_into_the_hf_engines_kv_and_it_decodes_the_same(producer, puller, runner):
    first, pull = _pull(producer, puller, "p1", PROMPT)
    engine = _engine(runner, kv_block_size=BS, prefix_caching_hash_algo="sha256_cbor")
    check_geometry(puller.geometry, engine.layout)
    full = len(PROMPT) // BS
    dests = engine.kv.cache.allocate(full * BS)
    sums = translate_blocks(puller.layers, pull.staging[:full], engine.kv.cache.data, dests)
    puller.release(pull)
    assert len(sums) == full and len(set(sums)) == full

    want_kv, want_tokens = _hf_kv(runner, PROMPT)
    got_kv = engine.kv.cache.data[dests]
    # vLLM's KV, translated, is the hf thinker's: bit for bit in layer 0, within float rounding of
    # two engines' kernels after it (measured max 2e-7).
    assert torch.equal(got_kv[:, :, 0], want_kv[:, :, 0])
    torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5)
    # Negative control: one perturbed value in one block fails that comparison.
    perturbed = got_kv.clone()
    perturbed[1, 3, 1, 0, 0, 5] += 1e-3
    with pytest.raises(AssertionError):
        torch.testing.assert_close(perturbed, want_kv, atol=1e-5, rtol=1e-5)

    # Named by vLLM's keys (sha256_cbor, vLLM's fixed seed: what the producer computed too), the
    # blocks are what the hf engine reuses for the prompt; its greedy tokens are hf colocated's.
    keys = VllmBlockHasher("sha256_cbor").block_hashes(PROMPT, BS)
    assert engine.kv.block_hashes(PROMPT, []) == keys
    engine.kv.register(dests, PROMPT, [])
    engine.kv.cache.release(dests)
    [out], _ = _run_together(
        engine, [ThinkerPrompt(list(PROMPT))], [SamplingParams(temperature=0, max_tokens=6)]
    )
    assert out.metrics["prefix_cached_tokens"] == full * BS
    assert out.token_ids == want_tokens and out.token_ids[0] == first
    assert engine.debug_state_counts() == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}


def test_a_second_prompt_moves_only_the_blocks_the_decode_side_lacks(producer, puller):
    """SECOND shares PROMPT's first 2 blocks: asking for its last 2 blocks only, exactly those move
    (the producer's blocks 2 and 3), into 2 staging blocks; a staging block not asked for keeps
    its sentinel."""
    assert (
        VllmBlockHasher("sha256_cbor").block_hashes(SECOND, BS)[:2]
        == (VllmBlockHasher("sha256_cbor").block_hashes(PROMPT, BS)[:2])
    )
    _, whole = _pull(producer, puller, "p2-whole", SECOND)
    want = [torch.stack([layer[s] for layer in puller.layers]).clone() for s in whole.staging]
    puller.release(whole)
    for layer in puller.layers:
        layer.fill_(7.0)  # sentinel
    _, delta = _pull(producer, puller, "p2-delta", SECOND, blocks=2)
    assert len(delta.staging) == 2
    for index, staging in enumerate(delta.staging):
        got = torch.stack([layer[staging] for layer in puller.layers])
        assert torch.equal(got, want[2 + index])  # the last two blocks, exact
    untouched = [b for b in range(puller.num_staging) if b not in delta.staging]
    assert all(bool((layer[untouched] == 7.0).all()) for layer in puller.layers)
    puller.release(delta)
    assert puller.debug_state_counts() == {"kv.vllm_pulls": 0, "kv.vllm_staging_blocks_held": 0}
    assert producer.call("released", "p2-delta-xfer") is True  # nothing left on the vLLM side


def test_incompatible_geometries_are_refused_by_name(geometry):
    ours = BlockLayout(BS, geometry.num_layers, geometry.num_kv_heads, geometry.head_size, "float32")
    check_geometry(geometry, ours)  # the control: the CI pair's geometry translates
    with pytest.raises(KVIncompatibleError, match="CPU attention kernel: vLLM 'amx'"):
        check_geometry(dataclasses.replace(geometry, attention_isa="amx"), ours)
    for field, value, needle in (
        ("num_layers", geometry.num_layers + 1, "layers (KV slots)"),
        ("block_size", 64, "block size"),
        ("num_kv_heads", geometry.num_kv_heads + 1, "KV heads"),
        ("head_dim", geometry.head_size * 2, "head dim"),
        ("dtype", "bfloat16", "dtype"),
    ):
        other = dataclasses.replace(ours, **{field: value})
        with pytest.raises(KVIncompatibleError, match=re.escape(needle)) as err:
            check_geometry(geometry, other)
        assert repr(value) in str(err.value)


def test_a_transfer_the_producer_never_published_is_a_bounded_miss(producer, puller):
    _, params = producer.call("prefill", "p3", PROMPT, "p3-xfer")
    worker = puller.worker_address(params["remote_bootstrap_addr"], params["remote_engine_id"], 10.0)
    _, done = _pull(producer, puller, "p3b", PROMPT)  # the producer serves others meanwhile
    puller.release(done)
    pull = puller.start("no-such-transfer", worker, 2, wait_s=0.5)
    with pytest.raises(KVMissError, match="within 0.5 s"):
        puller.wait(pull, 10)
    puller.release(pull)  # its staging blocks stay quarantined until the producer answers
    assert puller.debug_state_counts()["kv.vllm_staging_blocks_held"] == 2
    # p3's KV is still held by the producer for a decode side that never came: pulled now, freed
    pull = puller.start(params["transfer_id"], worker, 4, wait_s=30)
    puller.wait(pull, 35)
    puller.release(pull)
    assert producer.call("released", params["transfer_id"]) is True


def _hf_decode(runner, stage_runner=ThinkerRunner, **engine_args):
    stage = load_pipeline_config(MIXED_CONFIG).stage(1)
    stage = stage.model_copy(update={"engine_args": stage.engine_args.model_copy(update=engine_args)})
    return DecodeEngine(stage, stage_runner(runner))


@pytest.fixture(scope="module")
def hf_decode(runner):
    engine = _hf_decode(runner)
    yield engine
    engine.close()


def _decode_request(engine, producer, request_id, ids, wait_s=30.0, **override):
    first, params = producer.call("prefill", request_id, ids, f"{request_id}-xfer")
    _add(engine, request_id, ids, {**params, **override}, wait_s)
    return first, params


def _add(engine, request_id, ids, params, wait_s=30.0):
    # This producer is vLLM's generic engine (no Qwen3-Omni hooks, which the pipelines add and
    # e2e/test_vllm_p_hf_d.py runs): the thinker's handoff state is the hooks' rope_deltas 0.
    params = {"rope_deltas": 0, **params}
    decode = build_decode_sampling_params(
        SamplingParams(temperature=0, max_tokens=6), params, params["transfer_id"]
    )
    decode = decode.replace(kv_transfer_params={**decode.kv_transfer_params, "kv_wait_s": wait_s})
    engine.add_request(request_id, ThinkerPrompt(list(ids)), decode)


def _finish(engine, request_id, limit_s=30.0):
    """Step until the request ends (bounded): its output and error."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.output, out.error
        time.sleep(engine.step_delay_s())  # the engine's own poll interval while a read is in flight
    raise AssertionError(f"request {request_id} did not end within {limit_s} s")


def _free_on_the_producer(producer, puller, params):
    """A transfer no decode side took: pulled and dropped, so vLLM frees its blocks now."""
    worker = puller.worker_address(params["remote_bootstrap_addr"], params["remote_engine_id"], 10.0)
    pull = puller.start(params["transfer_id"], worker, 4, wait_s=30)
    puller.wait(pull, 35)
    puller.release(pull)
    assert producer.call("released", params["transfer_id"]) is True


def test_the_hf_decode_engine_decodes_from_the_vllm_prefill_engines_kv(producer, geometry, hf_decode, runner):
    first, params = _decode_request(hf_decode, producer, "d1", PROMPT)
    info = VllmProducerInfo.from_dict(params[VLLM_KV_KEY])
    assert info.geometry == geometry and info.hash_algo == "sha256_cbor"
    assert params["first_token"] == first and params["kv_cacheable"] is True
    out, error = _finish(hf_decode, "d1")
    assert error is None, error
    _, want = _hf_kv(runner, PROMPT)
    assert out.token_ids == want and out.token_ids[0] == first
    assert out.metrics["kv_blocks_transferred"] == 4 and out.metrics["kv_path"] == "vllm-mooncake"
    assert all(v == 0 for v in hf_decode.debug_state_counts().values()), hf_decode.debug_state_counts()
    assert producer.call("released", "d1-xfer") is True


def test_a_mismatched_producer_is_refused_at_the_first_handoff_naming_both_values(
    producer, puller, runner, hf_decode
):
    other = _hf_decode(runner, prefix_caching_hash_algo="sha256")
    _, params = producer.call("prefill", "d2", PROMPT, "d2-xfer")
    try:
        with pytest.raises(KVIncompatibleError) as err:
            _add(other, "d2", PROMPT, params)
        assert "vLLM prefix_caching_hash_algo 'sha256_cbor'" in str(err.value)
        assert "'vllm:sha256'" in str(err.value)
        assert all(v == 0 for v in other.debug_state_counts().values())
        # A producer on a vLLM whose connector messages were not checked: refused by version.
        assert params[VLLM_KV_KEY]["vllm_version"].startswith("0.32.0")  # the real one passes
        newer = {**params, VLLM_KV_KEY: {**params[VLLM_KV_KEY], "vllm_version": "0.33.0"}}
        with pytest.raises(KVIncompatibleError, match="vLLM prefill engine runs vLLM 0.33.0"):
            _add(hf_decode, "d2v", PROMPT, newer)
        assert all(v == 0 for v in hf_decode.debug_state_counts().values())
    finally:
        other.close()
    _free_on_the_producer(producer, puller, params)


def test_a_missing_transfer_is_a_bounded_miss_on_the_decode_engine(producer, puller, hf_decode):
    _, params = _decode_request(
        hf_decode, producer, "d3", SECOND, wait_s=0.5, transfer_id="d3-never-published"
    )
    began = time.monotonic()
    out, error = _finish(hf_decode, "d3")
    assert out is None and "KVMissError" in error and "within 0.5 s" in error, error
    assert time.monotonic() - began < 0.5 + 2.0  # the wait, not vLLM's 60 s lease
    counts = hf_decode.debug_state_counts()
    # The request is gone; its staging blocks stay quarantined until the producer answers.
    assert counts["thinker.requests"] == 0 and counts["thinker.kv_blocks_in_use"] == 0
    assert counts["kv.vllm_pulls"] == 1
    _free_on_the_producer(producer, puller, {**params, "transfer_id": "d3-xfer"})


class LogprobRunner(ThinkerRunner):
    """The thinker's runner, keeping each request's log-probabilities (the whole vocabulary) at
    every step it samples: what the log-prob bound compares."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logprobs: dict[str, list[torch.Tensor]] = {}

    def sample(self, requests, logits, first):
        for request, row in zip(requests, logits):
            self.logprobs.setdefault(request.request_id, []).append(torch.log_softmax(row.float(), -1))
        return super().sample(requests, logits, first)


def _colocated_logprobs(runner, ids):
    recording = LogprobRunner(runner, _stage().engine_args.attention_kernels)
    engine = ar_engine(_stage(kv_block_size=BS), recording)
    [out], _ = _run_together(
        engine, [ThinkerPrompt(list(ids))], [SamplingParams(temperature=0, max_tokens=6)]
    )
    return out.token_ids, torch.stack(recording.logprobs["r0"])


def test_log_probs_from_vllms_kv_stay_within_the_vllm_vs_transformers_bound(producer, runner):
    """Issue 40, item 4: decoding from the vLLM prefill's KV, every log-probability of every
    step the hf decode engine samples stays within LOGPROB_TOL (the bound
    tests/inproc_vllm_omni_thinker.py holds vLLM's thinker to against transformers) of hf
    colocated's at the same step. Negative control: a prompt one token away is far outside it."""
    decode = _hf_decode(runner, stage_runner=LogprobRunner)
    try:
        first, _ = _decode_request(decode, producer, "lp1", PROMPT)
        out, error = _finish(decode, "lp1")
        assert error is None, error
        mixed = torch.stack(decode.runner.logprobs["lp1"])
        assert all(v == 0 for v in decode.debug_state_counts().values())
    finally:
        decode.close()
    tokens, colocated = _colocated_logprobs(runner, PROMPT)
    assert out.token_ids == tokens and tokens[0] == first
    # The decode leg samples tokens 2..6 (the first is the vLLM prefill's): colocated's rows 1..5.
    assert mixed.shape == colocated[1:].shape == (len(tokens) - 1, colocated.shape[1])
    worst = (mixed - colocated[1:]).abs().max().item()
    print(f"vLLM prefill -> hf decode vs hf colocated: max |log-prob difference| {worst:.2e}")
    assert worst <= LOGPROB_TOL
    _, other = _colocated_logprobs(runner, PROMPT[:-1] + [PROMPT[-1] + 1])
    assert (other[1:] - colocated[1:]).abs().max().item() > 100 * LOGPROB_TOL


def test_a_first_pull_asks_the_bootstrap_server_on_its_own_thread(geometry):
    """The first pull from a producer queries its bootstrap server off the caller's thread (an
    engine step): start_at returns while the server still holds the query. A failed query is
    the pull's error, naming the server, and its staging is given back."""
    import http.server
    import threading

    asked, answer = threading.Event(), threading.Event()

    class Held(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.set()
            answer.wait(30)
            self.send_error(503)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Held)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    puller = VllmKVPuller(MooncakeTransport(), geometry, staging_blocks=4)
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}"
        pull = puller.start_at("t-held", address, "engine-x", 2, wait_s=20.0)
        assert asked.wait(20) and not pull.result.done()  # returned while the query is held
        assert puller.debug_state_counts() == {"kv.vllm_pulls": 1, "kv.vllm_staging_blocks_held": 2}
        answer.set()
        with pytest.raises(Exception) as err:
            puller.wait(pull, 20)
        assert "bootstrap server" in str(err.value) and address in str(err.value)
        assert puller.debug_state_counts() == {"kv.vllm_pulls": 0, "kv.vllm_staging_blocks_held": 0}
    finally:
        answer.set()
        puller.close()
        server.shutdown()


def test_a_prompt_the_prefix_cache_holds_whole_frees_the_producers_copy_at_once(producer, hf_decode):
    """A decode request whose prompt the prefix cache holds whole (whole blocks, seen before)
    moves nothing and tells the producer so, as vLLM's own consumer does: vLLM frees its copy at
    once instead of at its abort timeout (480 s by default; meanwhile the prefill engine's
    release_kv waited its 2 s and held new prefills up). Without that message the producer
    still holds the blocks when `released` gives up waiting (10 s): the negative control."""
    ids = [(13 * i + 5) % 200 + 20 for i in range(2 * BS)]
    _decode_request(hf_decode, producer, "w1", ids)
    out, error = _finish(hf_decode, "w1")
    assert error is None and out.metrics["kv_blocks_transferred"] == 2
    assert producer.call("released", "w1-xfer") is True
    _decode_request(hf_decode, producer, "w2", ids)
    out, error = _finish(hf_decode, "w2")
    assert error is None and out.metrics["kv_path"] == "cached"
    began = time.monotonic()
    assert producer.call("released", "w2-xfer") is True
    assert time.monotonic() - began < 5.0
    counts = hf_decode.debug_state_counts()  # (an earlier test's never-answered pull may stay quarantined)
    assert counts["thinker.requests"] == 0 and counts["thinker.kv_blocks_in_use"] == 0, counts


def test_a_request_that_leaves_before_its_pull_frees_the_producers_copy_at_once(producer, hf_decode):
    """Aborted before it asked the producer (still waiting for admission), a decode request
    tells the producer to free its copy, as one whose prompt is cached does."""
    ids = [(17 * i + 9) % 200 + 20 for i in range(BS + 3)]
    _decode_request(hf_decode, producer, "a1", ids)
    hf_decode.abort_request("a1")  # before any step: its pull never started
    began = time.monotonic()
    assert producer.call("released", "a1-xfer") is True
    assert time.monotonic() - began < 5.0
    counts = hf_decode.debug_state_counts()
    assert counts["thinker.requests"] == 0 and counts["thinker.kv_blocks_in_use"] == 0, counts


def test_closing_the_puller_ends_an_abandoned_pulls_wait_at_once(producer, geometry):
    """A pull that missed its window keeps listening for the producer's answer (its staging is
    quarantined until then, up to ABANDONED_ANSWER_S); closing the puller ends that wait within
    a poll slice, before the ZMQ context goes (never under a polling thread), and leaves no
    thread behind (one left would hold the interpreter's exit)."""
    import threading

    puller = VllmKVPuller(MooncakeTransport(), geometry, staging_blocks=4)
    try:
        _, params = producer.call("prefill", "c1", PROMPT, "c1-xfer")
        worker = puller.worker_address(params["remote_bootstrap_addr"], params["remote_engine_id"], 10.0)
        pull = puller.start("c1-never-published", worker, 2, wait_s=0.2)
        with pytest.raises(KVMissError):
            puller.wait(pull, 10)
        puller.release(pull)
        assert puller.debug_state_counts()["kv.vllm_pulls"] == 1  # still listening
    finally:
        began = time.monotonic()
        puller.close()
    assert time.monotonic() - began < 2.0
    assert not [t for t in threading.enumerate() if t.name.startswith(puller.thread_prefix)]
    # c1's KV is still held by the producer for a decode side that never came: pulled now, freed
    other = VllmKVPuller(MooncakeTransport(), geometry, staging_blocks=4)
    try:
        done = other.start("c1-xfer", worker, 4, wait_s=30)
        other.wait(done, 35)
        other.release(done)
    finally:
        other.close()
    assert producer.call("released", "c1-xfer") is True
