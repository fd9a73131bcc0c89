"""Qwen2.5-Omni served (issue 49, item 5): `omni-pd serve` with the model named answers chat with
text and speech, streamed and whole, and the Realtime API speaks with it; its voices are its own.
Quick forms: the tiny model, its P/D stage file."""

from __future__ import annotations

import base64
import io
import sys

import httpx
import numpy as np
import pytest
import soundfile

from live_server import Server, wait_for
from omni_pd.models.qwen2_5_omni.tiny_config import TINY_MODEL_NAME
from omni_pd.paths import STAGE_CONFIGS_DIR

pytestmark = pytest.mark.slow
PD = STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_pd.yaml"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _command(port: int) -> list[str]:
    return [
        sys.executable, "-m", "omni_pd.entrypoints.cli", "--log-level", "INFO", "serve", TINY_MODEL_NAME,
        "--stage-configs-path", str(PD), "--port", str(port), "--enable-debug-endpoints",
        "--request-timeout", "120",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    srv = Server(command=_command)
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


def test_chat_answers_with_text_and_speech_whole_and_streamed(server):
    whole = server.client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "wav"},
    )
    message = whole.choices[0].message
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    assert rate == 24_000 and samples.size > 0 and 0.05 < np.abs(samples).max() <= 1.0
    assert message.audio.transcript == message.content
    stream = server.client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "pcm16"},
        stream=True,
    )
    text, pcm = "", b""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        if delta.audio is not None and delta.audio.data:
            pcm += base64.b64decode(delta.audio.data)
    assert text == message.content
    streamed = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767
    assert streamed.shape == samples.shape and np.abs(streamed - samples).max() < 1e-4  # the same speech


def test_its_voices_are_its_own(server):
    ethan = server.client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
    )
    assert ethan.choices[0].message.audio.data
    reply = httpx.post(
        f"{server.base}/v1/chat/completions",
        json={
            "model": TINY_MODEL_NAME,
            "messages": MESSAGES,
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy"},
        },
        timeout=60,
    )
    assert reply.status_code == 400
    assert "chelsie" in reply.text and "ethan" in reply.text


def test_the_realtime_api_speaks_with_it(server):
    with server.client.realtime.connect(model=TINY_MODEL_NAME) as conn:
        assert conn.recv().type == "session.created"
        assert conn.recv().type == "conversation.created"
        conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        events = []
        for event in conn:
            assert event.type != "error", event.error
            if event.type == "session.updated":
                break
        conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": MESSAGES[0]["content"]}],
            }
        )
        conn.response.create()
        for event in conn:
            assert event.type != "error", event.error
            events.append(event)
            if event.type == "response.done":
                break
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    assert len(audio) > 0 and np.abs(np.frombuffer(audio, dtype="<i2")).max() > 0
    want = server.client.chat.completions.create(model=TINY_MODEL_NAME, messages=MESSAGES)
    assert transcript == want.choices[0].message.content
