"""The stage worker's step loop and the stage client, with many requests in flight: each answer
reaches its own request, aborts and failures touch only their request, and Shutdown stops a busy
worker."""

import asyncio
import multiprocessing as mp
import os
import pickle
import threading
import time

import pytest

from omni_pd.config import load_pipeline_config
from omni_pd.engines.base import BatchStats, StageEngine, StepOutput
from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.orchestrator import messages as msg
from omni_pd.orchestrator.stage_client import StageClient, StageError, StageTimeout
from omni_pd.orchestrator.worker import serve
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=3)


class CountingEngine(StageEngine):
    """Request `name` yields tokens [len(name), len(name)+1, ...], one per step, `max_tokens`
    of them. Prompt "bad" is refused; prompt "explode" makes the next step raise."""

    def __init__(self):
        self.stage_id = 7
        self.requests: dict[str, dict] = {}
        self.stats = BatchStats()
        self.closed = False
        self.gate = threading.Event()  # step() waits for it: lets a test queue requests first
        self.gate.set()

    def add_request(
        self, request_id, prompt, params, stream=False, chunks=False, chunk_sizes=None, rows=True
    ):
        if prompt == "bad":
            raise ValueError("prompt 'bad' is refused")
        self.requests[request_id] = {"prompt": prompt, "params": params, "stream": stream, "tokens": []}

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def request_ids(self):
        return list(self.requests)

    def step(self):
        self.gate.wait(10)
        if any(r["prompt"] == "explode" for r in self.requests.values()):
            raise RuntimeError("kaboom")
        self.stats.record(0, len(self.requests))
        outputs = []
        for request_id, r in list(self.requests.items()):
            token = len(r["prompt"]) + len(r["tokens"])
            r["tokens"].append(token)
            done = len(r["tokens"]) >= r["params"].max_tokens
            if done:
                del self.requests[request_id]
            outputs.append(
                StepOutput(
                    request_id,
                    [token] if r["stream"] else [],
                    finished=done,
                    output=list(r["tokens"]) if done else None,
                )
            )
        return outputs

    def close(self):
        self.closed = True


@pytest.fixture
def worker():
    """A CountingEngine served on a thread; yields (engine, orchestrator end of the pipe)."""
    engine = CountingEngine()
    ours, theirs = mp.Pipe(duplex=True)
    thread = threading.Thread(target=serve, args=(engine, theirs, lambda: True), daemon=True)
    thread.start()
    yield engine, ours
    if thread.is_alive():
        try:
            ours.send_bytes(msg.dumps(msg.Shutdown()))
        except BrokenPipeError:  # the loop already ended
            pass
        thread.join(10)
    assert not thread.is_alive()


def _send(conn, message):
    conn.send_bytes(msg.dumps(message))


def _receive_until(conn, done, timeout_s=10.0):
    """Messages (StepMessages unpacked) until `done(received)` holds."""
    received = []
    while not done(received):
        assert conn.poll(timeout_s), f"no message within {timeout_s} s; got {received}"
        message = msg.loads(conn.recv_bytes())
        received.extend(message.messages if isinstance(message, msg.StepMessages) else [message])
    return received


def _messages_for(conn, seconds):
    """Every message (heartbeats included) that arrives within `seconds`."""
    received, end = [], time.monotonic() + seconds
    while conn.poll(max(end - time.monotonic(), 0)):
        message = msg.loads(conn.recv_bytes())
        received.extend(message.messages if isinstance(message, msg.StepMessages) else [message])
    return received


def _finals(received):
    return {m.request_id: m for m in received if isinstance(m, (msg.GenerateResult, msg.GenerateFailed))}


def test_many_requests_in_flight_each_answer_reaches_its_request(worker):
    engine, conn = worker
    names = ["a", "bb", "ccc", "dddd", "eeeee"]
    engine.gate.clear()  # the first step (request "a" alone) waits until all are queued
    for name in names:
        _send(conn, msg.AddRequest(name, name, PARAMS, stream=name != "a"))
    engine.gate.set()
    received = _receive_until(conn, lambda got: len(_finals(got)) == len(names))
    finals = _finals(received)
    for name in names:
        want = [len(name), len(name) + 1, len(name) + 2]
        assert finals[name].output == want
        deltas = [
            t for m in received if isinstance(m, msg.TokenDelta) and m.request_id == name for t in m.token_ids
        ]
        assert deltas == (want if name != "a" else [])
    assert engine.stats.max_decode_batch == len(names)  # they shared steps
    assert not engine.requests


def test_abort_and_refusal_touch_only_their_request(worker):
    engine, conn = worker
    _send(conn, msg.AddRequest("keep", "keep", SamplingParams(max_tokens=50)))
    _send(conn, msg.AddRequest("drop", "drop", SamplingParams(max_tokens=10**9)))  # until aborted
    _send(conn, msg.AddRequest("refused", "bad", PARAMS))
    _send(conn, msg.Abort("drop"))
    _send(conn, msg.Abort("never-added"))
    finals = _finals(_receive_until(conn, lambda got: {"keep", "refused"} <= set(_finals(got))))
    assert "drop" not in finals
    assert (
        isinstance(finals["refused"], msg.GenerateFailed) and "'bad' is refused" in finals["refused"].message
    )
    assert finals["keep"].output[-1] == 4 + 49
    _send(conn, msg.ControlRequest(1, "debug_state_counts", {}))
    reply = _receive_until(conn, lambda got: any(isinstance(m, msg.ControlResult) for m in got))[-1]
    assert reply.call_id == 1 and reply.error is None and not engine.requests


def test_a_failing_step_fails_every_held_request_and_the_worker_goes_on(worker):
    engine, conn = worker
    _send(conn, msg.AddRequest("x", "xx", SamplingParams(max_tokens=10**9)))
    _send(conn, msg.AddRequest("boom", "explode", PARAMS))
    finals = _finals(_receive_until(conn, lambda got: len(_finals(got)) == 2))
    assert all(isinstance(m, msg.GenerateFailed) and "kaboom" in m.message for m in finals.values())
    assert not engine.requests
    _send(conn, msg.AddRequest("after", "after", PARAMS))
    assert _finals(_receive_until(conn, lambda got: "after" in _finals(got)))["after"].output == [5, 6, 7]


def test_shutdown_stops_a_busy_worker(worker):
    engine, conn = worker
    for i in range(3):
        _send(conn, msg.AddRequest(f"long{i}", "long", SamplingParams(max_tokens=10**9)))
    _send(conn, msg.Shutdown())  # while three requests that never end are running
    with pytest.raises(EOFError):  # the worker closed its end once its loop ended
        while True:
            assert conn.poll(10)
            conn.recv_bytes()
    assert engine.closed


TINY = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"


def test_stage_client_routes_concurrent_requests_and_aborts_on_timeout():
    """A real thinker behind the same pipe protocol on a thread (`runtime.process: false`)."""
    stage = load_pipeline_config(TINY).stage(0)
    stage = stage.model_copy(update={"runtime": stage.runtime.model_copy(update={"process": False})})
    client = StageClient(stage, "tiny-qwen3-omni", startup_timeout_s=120)
    try:
        client.wait_ready()
        prompts = [
            ThinkerPrompt([260, 257, 10] + [97 + i] * (i + 1) + [261, 10, 260, 258, 10]) for i in range(4)
        ]
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

        async def run():
            streamed = {i: [] for i in range(4)}
            outs = await asyncio.gather(
                *[
                    client.generate(f"r{i}", p, greedy, 60, on_tokens=streamed[i].extend)
                    for i, p in enumerate(prompts)
                ]
            )
            long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
            with pytest.raises(StageTimeout, match="did not finish request slow"):
                await client.generate("slow", prompts[0], long, 0.3)
            # An abort (a client that went away) ends the wait at once: the worker sends nothing
            # for an aborted request, so the client itself answers the waiter.
            task = asyncio.ensure_future(client.generate("gone", prompts[1], long, 600))
            first = asyncio.Event()
            task2 = asyncio.ensure_future(
                client.generate("witness", prompts[2], greedy, 60, on_tokens=lambda _: first.set())
            )
            await first.wait()  # the worker is stepping; "gone" is in flight
            client.abort("gone")
            with pytest.raises(StageError, match="request gone was aborted"):
                await asyncio.wait_for(task, 10)
            await task2
            return outs, streamed

        outs, streamed = asyncio.run(run())
        for i, out in enumerate(outs):
            assert len(out.token_ids) == 8 and streamed[i] == out.token_ids
        assert client.control("batch_stats")["max_decode_batch"] > 1
        # The timed-out request was aborted in the engine: nothing is held.
        assert client.control("debug_state_counts") == {"thinker.requests": 0, "thinker.kv_blocks_in_use": 0}
        assert client.in_flight() == 0
    finally:
        client.close()
    with pytest.raises(StageError, match="stopped"):
        asyncio.run(client.generate("late", prompts[0], greedy, 5))


def test_a_dead_worker_is_restarted_until_it_dies_too_often():
    """A worker process killed once is restarted (the waiter in it fails naming the signal, a
    request sent during the restart waits for it); killed once more than `max_restarts`
    allows, it is left down and says why."""
    import os
    import signal

    from omni_pd.orchestrator.stage_client import StageUnavailable
    from omni_pd.orchestrator.supervisor import StageStatus

    stage = load_pipeline_config(TINY).stage(0)
    stage = stage.model_copy(
        update={"runtime": stage.runtime.model_copy(update={"max_restarts": 1, "restart_window_s": 600})}
    )
    client = StageClient(stage, "tiny-qwen3-omni", startup_timeout_s=120)
    prompt = ThinkerPrompt([260, 257, 10, 97, 261, 10, 260, 258, 10])
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    try:
        client.wait_ready()
        first_pid = client.process.pid

        async def killed_mid_request() -> str:
            started = asyncio.Event()
            task = asyncio.ensure_future(
                client.generate("victim", prompt, long, 60, on_tokens=lambda _: started.set())
            )
            await started.wait()
            os.kill(client.process.pid, signal.SIGKILL)
            with pytest.raises(StageError) as err:
                await task
            return str(err.value)

        message = asyncio.run(killed_mid_request())
        assert "stage 0 (thinker)" in message and "SIGKILL" in message and "restart" in message
        assert client.status in (StageStatus.RESTARTING, StageStatus.UP)

        async def after_restart():
            await client.wait_usable(60)  # waits while it restarts
            return await client.generate("next", prompt, greedy, 60)

        assert len(asyncio.run(after_restart()).token_ids) == 4
        assert client.process.pid != first_pid and client.restarts == 1

        os.kill(client.process.pid, signal.SIGKILL)  # a second death within the window
        import multiprocessing.connection

        assert multiprocessing.connection.wait([client.process.sentinel], 10)  # it is gone

        async def down():
            with pytest.raises(StageUnavailable) as err:
                await client.wait_usable(60)
            return str(err.value)

        message = asyncio.run(down())
        assert client.status is StageStatus.DOWN
        assert "stage 0 (thinker) is down" in message and "max_restarts (1)" in message, message
        assert "SIGKILL" in message
    finally:
        client.close()


def test_tensors_cross_the_pipe_as_their_values():
    """Every dtype the stages send (bfloat16 included, which numpy lacks), empty, strided and
    0-d tensors arrive equal; a view carries only its own values, not its base's storage (torch's
    reducer sends the whole storage)."""
    import torch
    from omni_pd.orchestrator import messages as msg

    base = torch.randn(1000, 64)
    tensors = [
        torch.randn(3, 4),
        torch.randn(3, 4).to(torch.bfloat16),
        torch.zeros(0, 5),
        torch.zeros(0, 2, dtype=torch.bfloat16),
        torch.arange(10)[2:9:3],
        torch.tensor(True),
        torch.randn(2, 3).t(),
        torch.randint(0, 9, (4,), dtype=torch.int16),
    ]
    back = msg.loads(msg.dumps(msg.ChunkOutput("r", tensors))).data
    for sent, got in zip(tensors, back, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    row = msg.dumps(msg.ChunkOutput("r", base[-1:]))
    assert len(row) < 1024 < base[-1:].numel() * 4 + 1024 < len(pickle.dumps(base[-1:]))


class IOWaitingEngine(CountingEngine):
    """A CountingEngine whose requests first wait for an I/O that the test ends (`land`): until
    then every step runs nothing and asks the worker to wait a minute before the next.
    `wakes`: whether it offers a wake fd that `land` signals."""

    def __init__(self, wakes: bool):
        super().__init__()
        self.landed = threading.Event()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK) if wakes else None
        self.idle_steps = 0

    def land(self):
        self.landed.set()
        if self.fd is not None:
            os.eventfd_write(self.fd, 1)

    def step(self):
        if not self.landed.is_set():
            self.idle_steps += 1
            return []
        return super().step()

    def step_delay_s(self):
        return 60.0 if self.requests and not self.landed.is_set() else 0.0

    def wake_fd(self):
        return self.fd


@pytest.mark.parametrize("wakes", [True, False], ids=["woken", "control-polling"])
def test_a_worker_waiting_on_io_steps_when_its_wake_fd_fires(wakes):
    """The worker loop waits on the engine's wake fd beside its pipe: an engine whose requests
    wait on I/O (step_delay_s a minute) is stepped as soon as the I/O ends, and the answer comes
    back at once, after one idle step. The control (no wake fd, the engine only polls): the same
    I/O ends, but the worker sleeps on in its wait, and no answer comes within 2 s."""
    engine = IOWaitingEngine(wakes)
    ours, theirs = mp.Pipe(duplex=True)
    thread = threading.Thread(target=serve, args=(engine, theirs, lambda: True), daemon=True)
    thread.start()
    try:
        _send(ours, msg.AddRequest("a", "a", PARAMS))
        assert _finals(_messages_for(ours, 0.5)) == {}  # waiting: nothing to answer yet
        engine.land()
        if wakes:
            finals = _finals(_receive_until(ours, lambda got: "a" in _finals(got), timeout_s=20.0))
            assert finals["a"].output == [1, 2, 3]
            assert engine.idle_steps == 1
        else:
            assert _finals(_messages_for(ours, 2.0)) == {}
    finally:
        _send(ours, msg.Shutdown())  # a message ends the control's wait too
        thread.join(10)
    assert not thread.is_alive()
