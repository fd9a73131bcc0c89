"""VllmEngine's step loop on a P/D pair (MooncakeConnector, CPU), each engine in its own
process driven like a stage worker drives it (add_request, then step() while it has requests,
idle otherwise): prefills batched together, their KV sent by the offline_drain thread while the
prefill engine's caller idles (and while it steps a later batch), decodes batched together, and
the result equals the same requests run whole (no KV transfer) on the prefill engine.

Needs vLLM and Mooncake (`OMNI_PD_VLLM=1 bash scripts/setup.sh`). Outside CI the module is
skipped without vLLM; in CI (CI=true) a missing vLLM is a failure, never a skip.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from vllm_required import TOKEN_PROMPTS, require_vllm

require_vllm()

from omni_pd import SamplingParams  # noqa: E402
from omni_pd.engines.types import TokenPrompt  # noqa: E402
from omni_pd.models.qwen3_omni.tiny_config import TINY_MODEL_NAME  # noqa: E402
from omni_pd.planning import build_decode_sampling_params, build_prefill_sampling_params  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
PD_CONFIG = REPO / "stage_configs/ci/qwen3_text_pd_vllm.yaml"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, seed=0, ignore_eos=True)
PROMPTS = TOKEN_PROMPTS
REPLY_TIMEOUT_S = 120


def _paced(engine):
    """engine.step(), then the wait the worker loop would make before the next one (a decode
    leg waiting for its KV waits on its wake fd, or a millisecond)."""
    outputs = engine.step()
    delay = engine.step_delay_s()
    if delay:
        engine.wait_for_io(delay)
    return outputs


def _run_woken(engine, patched: bool):
    """Step a decode leg until idle as the worker does, with every wait for KV timed against
    its wake fd: (finals, waits for KV, waits the fd ended). Unpatched (the control), the
    connector's receives signal nothing, and each wait runs out its short window."""
    import select

    from omni_pd.engines.vllm.engine import KV_WAIT_S
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    names = ("process_pulling_result", "_handle_failed_recv")
    patched_methods = {n: getattr(mc.MooncakeConnectorWorker, n) for n in names}
    if not patched:
        for name, method in patched_methods.items():
            setattr(mc.MooncakeConnectorWorker, name, method.__wrapped__)
    finals, waits, woken = {}, 0, 0
    try:
        while engine.has_unfinished_requests():
            finals.update({o.request_id: (o.error, o.output) for o in engine.step() if o.finished})
            if engine.step_delay_s() >= KV_WAIT_S:  # every request waits for its KV
                waits += 1
                ready, _, _ = select.select([engine.wake_fd()], [], [], 30.0 if patched else 0.5)
                woken += bool(ready)
                engine.wait_for_io(0)  # resets the fd
    finally:
        for name, method in patched_methods.items():
            setattr(mc.MooncakeConnectorWorker, name, method)
    return finals, waits, woken


_peers: list[bytes] = []


def _record_peers() -> list[bytes]:
    """The ZMQ identities (one per connection) of the pulls this prefill worker has answered
    since the last call: MooncakeConnectorWorker.send_kv_to_decode recorded from the first."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    worker = mc.MooncakeConnectorWorker
    if not getattr(worker.send_kv_to_decode, "records_peers", False):
        original = worker.send_kv_to_decode

        async def send_kv_to_decode(self, identity, sock, meta):
            _peers.append(bytes(identity))
            return await original(self, identity, sock, meta)

        send_kv_to_decode.records_peers = True
        worker.send_kv_to_decode = send_kv_to_decode
    seen = list(_peers)
    _peers.clear()
    return seen


_pooled_make_socket = None  # receiver_socket_reuse's make_zmq_socket, once seen


def _keep_sockets(keep: bool) -> dict[str, int]:
    """receiver_socket_reuse on (the pool) or off (vLLM's own make_zmq_socket, the control);
    returns the pool's counts."""
    global _pooled_make_socket
    from omni_pd.engines.vllm.patches import receiver_socket_reuse
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    if _pooled_make_socket is None:  # installed when the engine started
        _pooled_make_socket = mc.make_zmq_socket
        assert getattr(_pooled_make_socket, "__omni_pd_patch__", False), "receiver_socket_reuse is off"
    mc.make_zmq_socket = _pooled_make_socket if keep else _pooled_make_socket.__wrapped__
    return receiver_socket_reuse.counts()


def _serve(config_path: str, stage_index: int, conn) -> None:
    """A minimal stage worker: one engine, commands over a pipe, steps only inside "run"."""
    from omni_pd.config import load_pipeline_config
    from omni_pd.engines.vllm.engine import build_vllm_engine

    stage = load_pipeline_config(config_path).stages[stage_index]
    engine = build_vllm_engine(stage, TINY_MODEL_NAME)
    conn.send(("ok", None))
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "add":
                result = engine.add_request(*args)
            elif cmd == "run":  # step until idle, as the worker loop does
                finals, deltas, batch = {}, {}, 0
                while engine.has_unfinished_requests():
                    outputs = _paced(engine)
                    batch = max(batch, sum(1 for o in outputs if o.new_token_ids))
                    for o in outputs:
                        deltas.setdefault(o.request_id, []).extend(o.new_token_ids)
                        if o.finished:
                            finals[o.request_id] = (o.error, o.output)
                result = (finals, deltas, batch)
            elif cmd == "run_steps":  # step until idle, counting the steps that gave tokens
                finals, deltas, steps = {}, {}, 0
                while engine.has_unfinished_requests():
                    outputs = _paced(engine)
                    steps += any(o.new_token_ids for o in outputs)
                    for o in outputs:
                        deltas.setdefault(o.request_id, []).extend(o.new_token_ids)
                        if o.finished:
                            finals[o.request_id] = (o.error, o.output)
                result = (finals, deltas, steps)
            elif cmd == "run_until":  # step until one request finishes, no further
                finals = {}
                while args[0] not in finals:
                    assert engine.has_unfinished_requests(), f"{args[0]} never finished"
                    finals.update({o.request_id: (o.error, o.output) for o in _paced(engine) if o.finished})
                result = finals
            elif cmd == "run_woken":
                result = _run_woken(engine, *args)
            elif cmd == "peers":  # the decode connections this prefill worker answered, from now
                result = _record_peers()
            elif cmd == "keep_sockets":  # the decode side's pull sockets kept (True) or not
                result = _keep_sockets(*args)
            elif cmd == "abort":
                result = engine.abort_request(args[0])
            elif cmd == "held":  # finished requests whose KV vLLM still holds for sending
                result = engine._held()
            elif cmd == "control":
                result = engine.control(args[0], **args[1])
            elif cmd == "close":
                engine.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(cmd)
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("ok", result))


class Leg:
    def __init__(self, ctx, config: Path, stage_index: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(str(config), stage_index, child), daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, *args):
        self.conn.send((cmd, args))
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise AssertionError(f"no reply to {cmd} within {REPLY_TIMEOUT_S} s")
        status, result = self.conn.recv()
        assert status == "ok", result
        return result

    def ready(self) -> None:
        assert self.conn.poll(REPLY_TIMEOUT_S), "engine did not start"
        status, result = self.conn.recv()
        assert status == "ok", result

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close")
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def legs():
    ctx = mp.get_context("spawn")
    started = {"prefill": Leg(ctx, PD_CONFIG, 0), "decode": Leg(ctx, PD_CONFIG, 1)}
    try:
        for leg in started.values():
            leg.ready()
        yield started
    finally:
        for leg in started.values():
            leg.close()


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_pd_batched_equals_colocated(legs):
    prefill, decode = legs["prefill"], legs["decode"]
    colocated = prefill  # requests without kv_transfer_params run whole on it
    for key, ids in PROMPTS.items():
        colocated.call("add", key, TokenPrompt(list(ids)), GREEDY, False)
    finals, _, _ = colocated.call("run")
    reference = {key: out.token_ids for key, (err, out) in finals.items()}
    assert all(err is None for err, _ in finals.values()), finals
    assert len({tuple(t) for t in reference.values()}) == len(PROMPTS)

    # Prefill in two batches; the first batch's KV waits while the second one is stepped.
    prefills = {}
    for batch in (("a", "b"), ("c", "d")):
        for key in batch:
            prefill.call(
                "add",
                key,
                TokenPrompt(list(PROMPTS[key])),
                build_prefill_sampling_params(GREEDY, f"xfer-{key}"),
                False,
            )
        finals, _, _ = prefill.call("run")
        assert sorted(finals) == sorted(batch)
        for key, (err, out) in finals.items():
            assert err is None, err
            assert out.kv_transfer_params["omni_pd_kv_published"] is True, out.kv_transfer_params
            prefills[key] = out
    # The prefill worker is idle now; vLLM holds every prefill's blocks for its decode side.
    assert prefill.call("held") == len(PROMPTS)

    # All four decodes at once: the KV is pulled while only the drain thread steps the prefill.
    for key, ids in PROMPTS.items():
        params = build_decode_sampling_params(GREEDY, prefills[key].kv_transfer_params, f"xfer-{key}")
        decode.call("add", key, TokenPrompt(list(ids)), params, True)
    finals, deltas, batch = decode.call("run")
    assert batch >= 2, "the decode step never served two requests at once"
    for key, ids in PROMPTS.items():
        err, out = finals[key]
        assert err is None, err
        assert out.token_ids == reference[key], key
        assert deltas[key] == out.token_ids
        assert out.num_cached_prompt_tokens == len(ids), (key, out.num_cached_prompt_tokens)
        assert {"e2e_ms", "first_token_ms"} <= set(out.metrics)

    # The drain thread finished the sends: vLLM frees every prefill's blocks on its own.
    assert wait_until(lambda: prefill.call("held") == 0), prefill.call("held")
    for key in PROMPTS:
        assert prefill.call("control", "release_kv", {"transfer_id": f"xfer-{key}"}) is True
    for leg in (prefill, decode):
        counts = leg.call("control", "debug_state_counts", {})
        assert all(v == 0 for v in counts.values()), counts


def test_abort_right_after_a_prefill_finishes(legs):
    """Prefill A finishes in a step that leaves B running; B is aborted before another step. A's
    KV send still goes out (vLLM announces it to its worker only in a later step, which the
    drain thread must take), so A's decode gets it."""
    prefill, decode = legs["prefill"], legs["decode"]
    colocated = prefill  # requests without kv_transfer_params run whole on it
    ids = PROMPTS["c"]
    colocated.call("add", "ref", TokenPrompt(list(ids)), GREEDY, False)
    finals, _, _ = colocated.call("run")
    err, want = finals["ref"]
    assert err is None, err
    prefill.call("add", "A", TokenPrompt(list(ids)), build_prefill_sampling_params(GREEDY, "xfer-A"), False)
    prefill.call(
        "add", "B", TokenPrompt(list(PROMPTS["d"])), dataclasses.replace(GREEDY, max_tokens=400), False
    )
    finals = prefill.call("run_until", "A")
    assert list(finals) == ["A"] and finals["A"][0] is None, finals
    # A busy prefill engine answers release_kv at once (only its own steps advance the send).
    began = time.monotonic()
    assert prefill.call("control", "release_kv", {"transfer_id": "xfer-A"}) is False
    assert time.monotonic() - began < 1.0
    prefill.call("abort", "B")  # the prefill worker is idle from here on
    params = build_decode_sampling_params(GREEDY, finals["A"][1].kv_transfer_params, "xfer-A")
    decode.call("add", "A", TokenPrompt(list(ids)), params, False)
    began = time.monotonic()
    finals, _, _ = decode.call("run")
    err, out = finals["A"]
    assert err is None, err
    assert out.token_ids == want.token_ids and out.num_cached_prompt_tokens == len(ids)
    assert time.monotonic() - began < 10, "the decode leg waited for its KV"
    assert wait_until(lambda: prefill.call("held") == 0)
    for leg in (prefill, decode):
        counts = leg.call("control", "debug_state_counts", {})
        assert all(v == 0 for v in counts.values()), counts


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
def test_the_decode_leg_starts_from_the_prefills_first_token(legs, params):
    """No wasted step (issue 48, item 2): the decode leg's prompt is the prompt plus the prefill's
    first token, so vLLM's first step samples the second token: one step fewer than a leg that
    recomputes the last prompt position (the control: the same handoff without `first_token`),
    same tokens and deltas. Seeded sampling keeps vLLM's way (the first token's draw from the
    request's generator must happen), and still equals colocated."""
    prefill, decode = legs["prefill"], legs["decode"]
    ids = PROMPTS["b"]
    prefill.call("add", "ref", TokenPrompt(list(ids)), params, False)
    finals, _, _ = prefill.call("run")
    want = finals["ref"][1].token_ids
    steps = {}
    for name in ("resumed", "recomputed"):
        transfer = f"xfer-first-{name}-{params.temperature}"
        prefill.call(
            "add", name, TokenPrompt(list(ids)), build_prefill_sampling_params(params, transfer), False
        )
        finals, _, _ = prefill.call("run")
        kv = dict(finals[name][1].kv_transfer_params)
        assert kv["first_token"] == want[0]
        if name == "recomputed":
            del kv["first_token"]
        decode.call(
            "add", name, TokenPrompt(list(ids)), build_decode_sampling_params(params, kv, transfer), True
        )
        finals, deltas, steps[name] = decode.call("run_steps")
        err, out = finals[name]
        assert err is None, err
        assert out.token_ids == want and deltas[name] == want, name
        assert out.num_cached_prompt_tokens == len(ids)
    assert steps["recomputed"] == params.max_tokens
    assert steps["resumed"] == (params.max_tokens - 1 if params.temperature == 0 else params.max_tokens)
    assert wait_until(lambda: prefill.call("held") == 0)
    for leg in (prefill, decode):
        counts = leg.call("control", "debug_state_counts", {})
        assert all(v == 0 for v in counts.values()), counts


@pytest.mark.parametrize("patched", [True, False], ids=["woken", "control-unpatched"])
def test_a_decode_leg_waiting_for_its_kv_is_woken_when_it_lands(legs, patched):
    """Event-driven waits (issue 48, item 3): while every request a decode leg holds waits for
    its KV, the engine asks the worker to wait (step_delay_s at KV_WAIT_S, not a spin), and the
    connector's receive wakes that wait through the engine's eventfd (recv_wake): every wait
    ends by the fd, within its 30 s timeout. The control unpatches the connector in the decode
    process: the same handoff finishes, but no wait sees the fd (each times out at 0.5 s, far
    past a same-host receive)."""
    prefill, decode = legs["prefill"], legs["decode"]
    ids = PROMPTS["c"]
    # A receive can land within the decode leg's first step, before it ever waits: then the
    # handoff says nothing about waking, and it is run again (a new transfer), up to 5 times.
    for attempt in range(5):
        transfer, name = f"xfer-wake-{patched}-{attempt}", f"w{attempt}"
        prefill.call(
            "add",
            f"p{attempt}",
            TokenPrompt(list(ids)),
            build_prefill_sampling_params(GREEDY, transfer),
            False,
        )
        finals, _, _ = prefill.call("run")
        kv = finals[f"p{attempt}"][1].kv_transfer_params
        decode.call(
            "add", name, TokenPrompt(list(ids)), build_decode_sampling_params(GREEDY, kv, transfer), False
        )
        finals, waits, woken = decode.call("run_woken", patched)
        err, out = finals[name]
        assert err is None, err
        assert out.num_cached_prompt_tokens == len(ids)
        assert wait_until(lambda: prefill.call("held") == 0)
        if waits:
            break
    assert waits >= 1, "the decode leg never waited for its KV (5 handoffs)"
    assert woken == (waits if patched else 0), (waits, woken)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "control-new-per-pull"])
def test_pulls_in_turn_reuse_one_connection_to_the_prefill_worker(legs, keep):
    """One connection per peer, not per pull (issue 48, item 4): four handoffs one after another
    reach the prefill worker over one ZMQ connection (one DEALER identity), kept between pulls by
    receiver_socket_reuse; each decode still equals colocated. The control runs vLLM's own
    make_zmq_socket in the decode process: a new connection (identity) per pull."""
    prefill, decode = legs["prefill"], legs["decode"]
    ids = PROMPTS["a"]
    prefill.call("add", "ref", TokenPrompt(list(ids)), GREEDY, False)
    finals, _, _ = prefill.call("run")
    want = finals["ref"][1].token_ids
    before = decode.call("keep_sockets", keep)
    prefill.call("peers")  # from here on
    for turn in range(4):
        transfer, name = f"xfer-conn-{keep}-{turn}", f"c{turn}"
        prefill.call(
            "add", name, TokenPrompt(list(ids)), build_prefill_sampling_params(GREEDY, transfer), False
        )
        finals, _, _ = prefill.call("run")
        kv = finals[name][1].kv_transfer_params
        decode.call(
            "add", name, TokenPrompt(list(ids)), build_decode_sampling_params(GREEDY, kv, transfer), False
        )
        finals, _, _ = decode.call("run")
        err, out = finals[name]
        assert err is None and out.token_ids == want, (err, turn)
        assert wait_until(lambda: prefill.call("held") == 0)
    peers = prefill.call("peers")
    after = decode.call("keep_sockets", True)
    assert len(peers) == 4, peers
    assert len(set(peers)) == (1 if keep else 4), peers
    if keep:  # at most one new socket (none if an earlier test left one kept), three reuses
        assert after["opened"] - before["opened"] <= 1 and after["reused"] - before["reused"] >= 3
    else:
        assert after == before
    for leg in (prefill, decode):
        counts = leg.call("control", "debug_state_counts", {})
        assert all(v == 0 for v in counts.values()), counts
