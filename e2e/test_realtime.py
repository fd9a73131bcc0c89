"""The Realtime API (/v1/realtime), live, through the official openai SDK: colocated and P/D.

Each answer is checked against the chat endpoint of the same server given the same history (the
thinker is greedy): equal text and equal prompt length mean the realtime session built the
prompt the chat request spells out. Speech comes from espeak-ng (e2e/speech.py)."""

from __future__ import annotations

import base64
import io
import json
import socket

import numpy as np
import openai
import pytest
import soundfile
import websockets.sync.client

from live_server import MODEL, Server, omni_pd_serve_command, wait_for
from omni_pd.models.qwen3_omni.pipeline import qwen3_omni_pipeline
from omni_pd.paths import STAGE_CONFIGS_DIR
from speech import pcm16, speak

pytestmark = pytest.mark.slow
API_KEY = "sk-realtime-test"
RATE = 24_000
COLOCATED = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
LONG = 400  # max_output_tokens of answers that are cut: far longer than the test waits


@pytest.fixture(scope="module", params=["colocated", "pd"])
def server(request):
    def command(port):
        extra = ["--stage-configs-path", str(COLOCATED)] if request.param == "colocated" else []
        return omni_pd_serve_command(port) + extra

    srv = Server(command=command, api_key=API_KEY)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(autouse=True)
def nothing_left(server):
    yield
    wait_for(
        lambda: all(v == 0 for v in server.state()["counts"].values()),
        30,
        "every per-request and per-session count to return to zero",
    )


@pytest.fixture(scope="module")
def speech_text():
    return qwen3_omni_pipeline(MODEL).speech_text


@pytest.fixture(scope="module")
def utterances():
    return {
        "weather": speak("Hello, what is the weather like today?"),
        "again": speak("Could you say that once more, please?"),
    }


def _connect(server):
    return server.client.realtime.connect(model=MODEL)


def _open(conn, **session):
    assert conn.recv().type == "session.created"
    assert conn.recv().type == "conversation.created"
    conn.session.update(session={"type": "realtime", **session})
    updated = _until(conn, "session.updated")[-1]
    return updated.session


def _until(conn, kind: str, also=None) -> list:
    """Events up to and including the first of `kind`; `also(event)` sees each on the way."""
    events = []
    for event in conn:
        assert event.type != "error", event.error
        events.append(event)
        if also:
            also(event)
        if event.type == kind:
            return events
    raise AssertionError(f"the socket closed before {kind}")


def _say(conn, text: str) -> None:
    conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    _until(conn, "conversation.item.done")


def _answer(conn, **response):
    """response.create, then every event to response.done: (done event, text deltas joined,
    pcm16 bytes)."""
    conn.response.create(**({"response": response} if response else {}))
    events = _until(conn, "response.done")
    text = "".join(
        e.delta
        for e in events
        if e.type in ("response.output_audio_transcript.delta", "response.output_text.delta")
    )
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    return events[-1], text, audio


def _chat(server, messages):
    reply = server.client.chat.completions.create(model=MODEL, messages=messages)
    return reply.choices[0].message.content, reply.usage


def _wav(samples: np.ndarray) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.frombuffer(pcm16(samples), dtype="<i2"), RATE, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_text_turn_answers_with_speech_and_its_transcript(server):
    with _connect(server) as conn:
        session = _open(conn, audio={"input": {"turn_detection": None}})
        assert session.output_modalities == ["audio"] and session.audio.input.turn_detection is None
        _say(conn, "Tell me about the sea.")
        done, text, audio = _answer(conn)
    assert done.response.status in ("completed", "incomplete")
    [item] = done.response.output
    assert item.role == "assistant" and item.content[0].transcript == text
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert np.abs(np.frombuffer(audio, dtype="<i2")).max() > 0
    want, usage = _chat(server, [{"role": "user", "content": "Tell me about the sea."}])
    assert text == want and done.response.usage.input_tokens == usage.prompt_tokens
    assert done.response.usage.output_tokens == usage.completion_tokens


def test_a_text_only_session_answers_in_text(server):
    with _connect(server) as conn:
        _open(conn, output_modalities=["text"], audio={"input": {"turn_detection": None}})
        _say(conn, "Tell me about the sea.")
        done, text, audio = _answer(conn)
    assert audio == b"" and done.response.output[0].content[0].text == text
    assert text == _chat(server, [{"role": "user", "content": "Tell me about the sea."}])[0]


def test_an_audio_turn_is_the_thinkers_audio_input(server, utterances):
    """Appended pcm16, committed by hand: the answer is the chat endpoint's for the same
    samples as an input_audio WAV. Negative control: other speech answers otherwise."""
    spoken = utterances["weather"]
    with _connect(server) as conn:
        _open(conn, audio={"input": {"turn_detection": None}})
        data = pcm16(spoken)
        for start in range(0, len(data), 9600):  # 200 ms a chunk
            conn.input_audio_buffer.append(audio=base64.b64encode(data[start : start + 9600]).decode())
        conn.input_audio_buffer.commit()
        committed = _until(conn, "input_audio_buffer.committed")[-1]
        added = _until(conn, "conversation.item.added")[-1]
        assert added.item.id == committed.item_id and added.item.content[0].type == "input_audio"
        done, text, _ = _answer(conn)
    want, usage = _chat(
        server,
        [
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": _wav(spoken), "format": "wav"}}],
            }
        ],
    )
    assert text == want and done.response.usage.input_tokens == usage.prompt_tokens
    other, other_usage = _chat(
        server,
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_audio",
                        "input_audio": {"data": _wav(utterances["again"]), "format": "wav"},
                    }
                ],
            }
        ],
    )
    assert other != want or other_usage.prompt_tokens != usage.prompt_tokens


def test_the_second_turn_carries_the_first(server):
    first, second = "Tell me about the sea.", "And about the mountains?"
    with _connect(server) as conn:
        _open(conn, audio={"input": {"turn_detection": None}})
        _say(conn, first)
        _, answer, _ = _answer(conn)
        _say(conn, second)
        done, text, _ = _answer(conn)
    history = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": second},
    ]
    want, usage = _chat(server, history)
    assert text == want and done.response.usage.input_tokens == usage.prompt_tokens
    # The first turn's blocks came from the prefix cache.
    assert done.response.usage.input_token_details.cached_tokens > 0
    # Negative control: without the first turn the prompt is another.
    assert _chat(server, history[2:])[1].prompt_tokens != usage.prompt_tokens


def test_cancel_stops_the_answer_and_keeps_what_was_heard(server, speech_text):
    with _connect(server) as conn:
        _open(conn, audio={"input": {"turn_detection": None}})
        _say(conn, "Tell me a long story.")
        conn.response.create(response={"max_output_tokens": LONG})
        events = _until(conn, "response.output_audio.delta")
        conn.response.cancel()
        events += _until(conn, "response.done")
        done = events[-1]
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "client_cancelled"
        text = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
        samples = sum(
            len(base64.b64decode(e.delta)) // 2 for e in events if e.type == "response.output_audio.delta"
        )
        deltas = sum(e.type == "response.output_audio_transcript.delta" for e in events)
        assert deltas < LONG  # it stopped: the answer had LONG tokens to go
        heard = done.response.output[0].content[0].transcript
        assert heard == speech_text(text, samples / RATE) and len(heard) < len(text)
        # The next turn works, with the answer as far as it was heard in its history.
        _say(conn, "Go on.")
        after, answer, _ = _answer(conn)
    assert after.response.status in ("completed", "incomplete")
    history = [{"role": "user", "content": "Tell me a long story."}]
    history += [{"role": "assistant", "content": heard}] if heard else []
    want, usage = _chat(server, history + [{"role": "user", "content": "Go on."}])
    assert answer == want and after.response.usage.input_tokens == usage.prompt_tokens


def test_server_vad_commits_speech_then_silence_and_barges_in(server, utterances):
    with _connect(server) as conn:
        session = _open(
            conn,
            max_output_tokens=LONG,
            audio={
                "input": {
                    "turn_detection": {"type": "server_vad", "threshold": 0.8, "silence_duration_ms": 400}
                }
            },
        )
        assert session.audio.input.turn_detection.type == "server_vad"

        def append(samples):
            data = pcm16(samples)
            for start in range(0, len(data), 960):  # 20 ms a chunk, as a microphone sends
                conn.input_audio_buffer.append(audio=base64.b64encode(data[start : start + 960]).decode())

        silence = np.zeros(RATE, dtype=np.float32)
        append(np.concatenate([silence[: RATE // 2], utterances["weather"], silence]))
        events = _until(conn, "response.output_audio.delta")
        kinds = [e.type for e in events]
        for kind in (
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "response.created",
        ):
            assert kind in kinds, kinds
        assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
        started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
        stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
        assert 0 <= started.audio_start_ms < 500 < stopped.audio_end_ms
        committed = next(e for e in events if e.type == "input_audio_buffer.committed")
        assert committed.item_id == started.item_id
        # The user speaks over the answer: it stops, and the new speech is the next turn.
        append(np.concatenate([utterances["again"], silence]))
        events = _until(conn, "response.done")
        assert events[-1].response.status == "cancelled"
        assert events[-1].response.status_details.reason == "turn_detected"
        assert "input_audio_buffer.speech_started" in [e.type for e in events]
        events = _until(conn, "response.created")
        assert "input_audio_buffer.committed" in [e.type for e in events]
        conn.response.cancel()
        assert _until(conn, "response.done")[-1].response.status == "cancelled"


def test_hostile_input_gets_one_error_each_and_the_session_goes_on(server):
    with _connect(server) as conn:
        _open(conn, audio={"input": {"turn_detection": None}})

        def error_for(raw):
            conn.send_raw(raw)
            event = conn.recv()
            assert event.type == "error", event
            return event.error

        assert error_for("{not json").code == "invalid_json"
        assert error_for(json.dumps({"type": "session.explode"})).param == "type"
        bad = error_for(json.dumps({"type": "input_audio_buffer.append", "audio": "%%%", "event_id": "e1"}))
        assert bad.param == "audio" and bad.event_id == "e1"
        assert (
            error_for(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {"type": "realtime", "audio": {"output": {"voice": "nobody"}}},
                    }
                )
            ).param
            == "session.audio.output.voice"
        )
        assert (
            error_for(json.dumps({"type": "session.update", "session": {"temperature": 2}})).param
            == "session.temperature"
        )
        assert error_for(json.dumps({"type": "response.cancel"})).code == "response_cancel_not_active"
        assert (
            error_for(json.dumps({"type": "input_audio_buffer.commit"})).code
            == "input_audio_buffer_commit_empty"
        )
        ten_seconds = base64.b64encode(bytes(RATE * 2 * 10)).decode()
        for _ in range(12):
            conn.input_audio_buffer.append(audio=ten_seconds)
        assert (
            error_for(json.dumps({"type": "input_audio_buffer.append", "audio": ten_seconds})).code
            == "input_audio_buffer_too_large"
        )
        conn.input_audio_buffer.clear()
        assert conn.recv().type == "input_audio_buffer.cleared"
        for _ in range(1000):  # one sample each: accepted, in order, silently
            conn.input_audio_buffer.append(audio="AAA=")
        conn.input_audio_buffer.clear()
        assert conn.recv().type == "input_audio_buffer.cleared"
        assert server.state()["counts"]["realtime.buffer_bytes"] == 0
        _say(conn, "Still there?")
        done, text, _ = _answer(conn, max_output_tokens=4)
        assert done.response.status in ("completed", "incomplete") and text


def test_an_abrupt_disconnect_mid_answer_frees_everything(server):
    url = server.base.replace("http", "ws") + f"/v1/realtime?model={MODEL}"
    with websockets.sync.client.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Talk."}],
                    },
                }
            )
        )
        ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": LONG}}))
        while json.loads(ws.recv())["type"] != "response.output_audio.delta":
            pass
        assert server.state()["counts"]["realtime.responses"] == 1
        ws.socket.shutdown(socket.SHUT_RDWR)  # no close frame: the peer is just gone
    # nothing_left checks that every count returns to zero.


def test_the_api_key_and_the_model_are_checked(server):
    wrong = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(Exception) as refused:
        with wrong.realtime.connect(model=MODEL) as conn:
            conn.recv()
    assert "401" in str(refused.value)
    with server.client.realtime.connect(model="not-this-model") as conn:
        event = conn.recv()
        assert event.type == "error" and event.error.param == "model"
        with pytest.raises(Exception):
            conn.recv()  # closed with 1008


def test_a_beta_client_gets_the_beta_event_names(server):
    # The beta client always dials wss:// from base_url; a plain-ws server names its URL.
    client = openai.OpenAI(
        base_url=f"{server.base}/v1",
        api_key=API_KEY,
        max_retries=0,
        websocket_base_url=server.base.replace("http", "ws") + "/v1",
    )
    with client.beta.realtime.connect(model=MODEL) as conn:
        assert conn.recv().type == "session.created"
        conn.recv()  # conversation.created
        conn.session.update(session={"modalities": ["text", "audio"], "turn_detection": None})
        updated = _until(conn, "session.updated")[-1]
        assert updated.session.turn_detection is None and updated.session.voice == "ethan"
        conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}
        )
        conn.response.create()
        kinds = [e.type for e in _until(conn, "response.done")]
    assert "conversation.item.created" in kinds and "conversation.item.added" not in kinds
    assert "response.audio.delta" in kinds and "response.audio_transcript.delta" in kinds
    assert "response.output_audio.delta" not in kinds
