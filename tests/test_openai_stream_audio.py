"""The server's streamed audio, against a scripted orchestrator that sends audio in several
pieces interleaved with text (the real pipeline may send one piece), through the `openai` client."""

from __future__ import annotations

import base64
import time
from types import SimpleNamespace
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator

import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from omni_pd.audio_io import DUMMY_WEIGHTS_PCM16_GAIN, to_pcm16
from omni_pd.entrypoints.openai.api_server import create_app
from omni_pd.models.qwen3_omni.records import ThinkerPrompt
from omni_pd.orchestrator.async_omni import AudioDelta, Finished, PreparedPrompt, TextDelta
from omni_pd.orchestrator.outputs import OmniRequestOutput
from omni_pd.sampling import SamplingParams

RATE = 24_000
PIECES = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * 6e-7 for n in (1920, 700, 3001)]
# Text before, between and after the audio pieces: the last text has no audio piece after it.
SCRIPT = [
    TextDelta("Hel"),
    AudioDelta(PIECES[0], RATE),
    TextDelta("lo"),
    TextDelta(" w"),
    AudioDelta(PIECES[1], RATE),
    AudioDelta(PIECES[2], RATE),
    TextDelta("orld"),
]
TEXT = "Hello world"


def _stage(stage_id: int, kind: str) -> SimpleNamespace:
    return SimpleNamespace(
        stage_id=stage_id,
        final_output=True,
        final_output_type=kind,
        engine_args=SimpleNamespace(load_format="dummy"),
        max_num_seqs=64,
        runtime=SimpleNamespace(num_replicas=1),
        default_sampling_params=SamplingParams(temperature=0.0, max_tokens=8),
    )


class ScriptedOmni:
    """What the server reads of an AsyncOmni, answering every request with `script` (SCRIPT)."""

    text_stage_id, pd_pair, max_model_len = 0, None, 4096

    def __init__(self, script: list[Any] = SCRIPT) -> None:
        self.script = script
        self.stages = {0: _stage(0, "text"), 1: _stage(1, "audio")}
        self.config = SimpleNamespace(stages=list(self.stages.values()))
        self.pipeline = SimpleNamespace(voices=("ethan",), dummy_weights_audio_gain=None)
        self.clients = {0: None, 1: None}

    def output(self) -> OmniRequestOutput:
        text = "".join(e.text for e in self.script if isinstance(e, TextDelta))
        pieces = [e.audio for e in self.script if isinstance(e, AudioDelta)]
        return OmniRequestOutput(
            request_id="r",
            prompt_token_ids=[1, 2],
            token_ids=[3, 4, 5],
            text=text,
            finish_reason="stop",
            audio=torch.cat(pieces) if pieces else None,
            sample_rate=RATE,
            metrics={"e2e_ms": 1.0, "stage_ms": {}},
        )

    async def stream(self, *_: Any, **__: Any) -> AsyncIterator[Any]:
        for event in self.script:
            yield event
        yield Finished(self.output())

    async def generate(self, *_: Any, **__: Any) -> OmniRequestOutput:
        return self.output()

    def prepare(self, prompt: Any) -> PreparedPrompt:
        return PreparedPrompt(prompt, ThinkerPrompt(prompt_token_ids=[1, 2]))

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "stages": {}}

    def close(self) -> None:
        pass


@contextmanager
def _client_for(script: list[Any]) -> Iterator[openai.OpenAI]:
    with TestClient(create_app(lambda: ScriptedOmni(script), "m")) as http:
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:  # the scripted stages start at once
            assert time.monotonic() < deadline, "the app never became healthy"
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )


@pytest.fixture(scope="module")
def client():
    with _client_for(SCRIPT) as scripted:
        yield scripted


def _audio_request(client, **kw):
    return client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        **kw,
    )


def test_each_audio_piece_is_one_pcm16_chunk_in_order_with_its_transcript(client):
    deltas = [c.choices[0].delta for c in _audio_request(client, stream=True) if c.choices]
    content = "".join(d.content or "" for d in deltas)
    audio = [d.audio for d in deltas if d.audio is not None]
    data = [a.data for a in audio if a.data]
    assert content == TEXT and len(data) == len(PIECES)
    got = np.frombuffer(b"".join(base64.b64decode(d) for d in data), dtype="<i2")
    want = to_pcm16(torch.cat(PIECES), DUMMY_WEIGHTS_PCM16_GAIN).numpy()
    assert np.array_equal(got, want)
    # Each piece goes out as it arrives: text and audio chunks keep the script's order.
    order = ["t" if d.content else "a" for d in deltas if d.content or (d.audio and d.audio.data)]
    assert order == ["t" if isinstance(e, TextDelta) else "a" for e in SCRIPT]
    assert [a.transcript for a in audio] == ["Hel", "lo w", "", "orld"]
    assert "".join(a.transcript for a in audio) == TEXT
    assert len({a.id for a in audio}) == 1 and audio[0].id
    assert audio[-1].expires_at and audio[-1].data is None
    assert all(a.expires_at is None for a in audio[:-1])
    # Negative controls: a dropped piece, or another gain, is noticed.
    dropped = np.frombuffer(b"".join(base64.b64decode(d) for d in data[:1] + data[2:]), dtype="<i2")
    assert not np.array_equal(dropped, want)
    assert not np.array_equal(got, to_pcm16(torch.cat(PIECES), 1.0).numpy())


def test_non_streamed_pcm16_is_the_whole_answer(client):
    audio = _audio_request(client).choices[0].message.audio
    got = np.frombuffer(base64.b64decode(audio.data), dtype="<i2")
    assert np.array_equal(got, to_pcm16(torch.cat(PIECES), DUMMY_WEIGHTS_PCM16_GAIN).numpy())
    assert audio.transcript == TEXT and audio.expires_at


def _first_delta(chunks) -> dict:
    first = next(c for c in chunks if c.choices)
    return first.choices[0].delta.model_dump(exclude_none=True)


def test_the_first_chunk_carries_the_role_with_the_first_text(client):
    """No role-only chunk ahead of the answer: a client timing its first chunk (vLLM's bench)
    would read that as the first token."""
    chunks = [c for c in _audio_request(client, stream=True) if c.choices]
    assert _first_delta(chunks) == {"role": "assistant", "content": "Hel"}
    assert all(c.choices[0].delta.role is None for c in chunks[1:])  # the role comes once


def test_audio_before_any_text_carries_the_role():
    with _client_for([AudioDelta(PIECES[0], RATE), TextDelta("Hi")]) as scripted:
        first = _first_delta(_audio_request(scripted, stream=True))
    assert first["role"] == "assistant" and first["audio"]["data"] and "content" not in first


def test_an_empty_answer_still_opens_with_the_role():
    with _client_for([]) as scripted:
        chunks = [c for c in _audio_request(scripted, stream=True) if c.choices]
    assert len(chunks) == 1 and chunks[0].choices[0].finish_reason == "stop"
    assert _first_delta(chunks) == {"role": "assistant", "content": ""}


def test_a_request_naming_no_modalities_gets_the_servers_default():
    """OpenAI answers such a request in text; `--default-modalities text,audio` answers it in
    text and speech, as vllm-omni's server does for its clients, which send no `modalities`.
    A request that names them still gets what it names."""

    def ask(http, **kw):
        return http.post(
            "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
        ).json()["choices"][0]["message"]

    for default, spoken in ((("text",), False), (("text", "audio"), True)):
        with TestClient(create_app(lambda: ScriptedOmni(), "m", default_modalities=default)) as http:
            deadline = time.monotonic() + 30
            while http.get("/health").status_code != 200:  # the scripted stages start at once
                assert time.monotonic() < deadline, "the app never became healthy"
            message = ask(http)
            assert message["content"] == TEXT and ("audio" in message) == spoken, default
            assert "audio" not in ask(http, modalities=["text"])
            assert "audio" in ask(http, modalities=["text", "audio"])
    with pytest.raises(ValueError, match="--default-modalities must be one of text, text,audio"):
        create_app(lambda: ScriptedOmni(), "m", default_modalities=("audio",))
