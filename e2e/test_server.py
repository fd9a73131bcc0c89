"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client."""

import base64
import io
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch

from dashboard_check import Exposition, load_dashboard, problems
from live_server import MODEL, Server, alive, omni_pd_serve_command, wait_for
from omni_pd.audio_io import stage_config_pcm16_gain, to_pcm16
from omni_pd.config import load_pipeline_config
from omni_pd.orchestrator.omni import Omni
from omni_pd.paths import default_stage_config
from omni_pd.sampling import SamplingParams

pytestmark = pytest.mark.slow
API_KEY = "sk-omni-pd-test"  # the module's server requires it (OMNI_PD_API_KEY); its client sends it


@pytest.fixture(scope="module")
def server():
    srv = Server(lambda port: omni_pd_serve_command(port) + ["--trace-hops"], api_key=API_KEY)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline():
    with Omni(model=MODEL) as omni:
        yield omni


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        wait_for(
            lambda: all(v == 0 for v in srv.state()["counts"].values()),
            30,
            "every per-request count on the server to return to zero",
        )


def _chat(server, text, **kw):
    return server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **kw
    )


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    _chat(server, "warm up", max_tokens=3)
    metrics = httpx.get(f"{server.base}/metrics").text
    for name in (
        "omni_pd_requests_total",
        "omni_pd_time_to_first_token_seconds_bucket",
        "omni_pd_stage_latency_seconds_bucket",
        "omni_pd_kv_transferred_bytes_total",
        "omni_pd_kv_handoff_seconds_bucket",
        "omni_pd_requests_in_flight",
    ):
        assert name in metrics, name
    assert 'omni_pd_requests_total{outcome="success"}' in metrics
    assert server.log_text().count("pcm16 audio: 24000 Hz mono int16 after a gain of") == 1


def test_text_only_matches_offline(server, offline):
    reply = _chat(server, "Tell me about the sea.", max_tokens=12, temperature=0)
    want = offline.generate(
        "Tell me about the sea.", [SamplingParams(temperature=0, max_tokens=12, seed=42), None, None]
    )[0]
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].message.audio is None
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)


def test_text_and_audio_wav_equals_offline_audio(server, offline):
    reply = _chat(
        server,
        "Say something.",
        max_tokens=10,
        temperature=0,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
    )
    audio = reply.choices[0].message.audio
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)), dtype="float32")
    want = offline.generate(
        "Say something.", [SamplingParams(temperature=0, max_tokens=10, seed=42), None, None]
    )[0]
    assert rate == want.sample_rate == 24_000
    assert torch.equal(torch.from_numpy(samples), want.audio)
    assert audio.transcript == reply.choices[0].message.content == want.text


def test_audio_input(server):
    tone = (0.2 * np.sin(np.arange(8000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, tone, 16000, format="WAV")
    reply = server.client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {
                        "type": "input_audio",
                        "input_audio": {
                            "data": base64.b64encode(buffer.getvalue()).decode(),
                            "format": "wav",
                        },
                    },
                ],
            }
        ],
    )
    assert reply.usage.prompt_tokens > 20  # the audio became many prompt positions


def _collect_stream(stream):
    """A streamed answer: its text deltas, `delta.audio` objects and finish reason."""
    text, audio, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
        if delta.audio is not None:
            audio.append(delta.audio)
        finish = chunk.choices[0].finish_reason or finish
    return text, audio, finish


def _int16(*pieces: str) -> np.ndarray:
    return np.frombuffer(b"".join(base64.b64decode(p) for p in pieces), dtype="<i2")


def test_streaming_deltas_add_up_to_the_full_answer(server):
    full = _chat(server, "Stream this please.", max_tokens=16, temperature=0)
    stream = _chat(
        server,
        "Stream this please.",
        max_tokens=16,
        temperature=0,
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
    )
    text, audio, finish = _collect_stream(stream)
    assert len(text) > 1 and "".join(text) == full.choices[0].message.content
    assert any(a.data for a in audio)
    assert finish == full.choices[0].finish_reason


def test_streamed_pcm16_equals_the_non_streamed_audio(server):
    kwargs = dict(max_tokens=10, temperature=0, modalities=["text", "audio"])
    pcm16 = {"voice": "ethan", "format": "pcm16"}
    text, audio, finish = _collect_stream(
        _chat(server, "Say it in pieces.", stream=True, audio=pcm16, **kwargs)
    )
    whole = _chat(server, "Say it in pieces.", audio=pcm16, **kwargs).choices[0]
    wav = (
        _chat(server, "Say it in pieces.", audio={"voice": "ethan", "format": "wav"}, **kwargs)
        .choices[0]
        .message.audio
    )
    data = [a.data for a in audio if a.data]
    streamed, want = _int16(*data), _int16(whole.message.audio.data)
    assert data and streamed.size > 0 and np.array_equal(streamed, want)
    # The non-streamed float WAV, converted with the server's gain, gives the same samples.
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(wav.data)), dtype="float32")
    gain = stage_config_pcm16_gain(load_pipeline_config(default_stage_config()).stages)
    assert rate == 24_000 and np.array_equal(to_pcm16(torch.from_numpy(samples), gain).numpy(), want)
    # The gain makes random-weight audio audible and clips (almost) nothing.
    assert np.abs(want).max() > 3000 and np.mean(np.abs(want) == 32767) < 0.01
    # Negative controls: one audio delta fewer, or another gain, is noticed.
    assert not np.array_equal(_int16(*data[:-1]), want)
    assert not np.array_equal(to_pcm16(torch.from_numpy(samples), gain / 2).numpy(), want)
    # One audio id; the transcripts add up to the text; only the last audio chunk expires.
    assert len({a.id for a in audio}) == 1 and audio[0].id
    assert "".join(a.transcript or "" for a in audio) == "".join(text) == whole.message.content
    assert audio[-1].expires_at and all(a.expires_at is None for a in audio[:-1])
    assert finish == whole.finish_reason


def _ttft_totals(server) -> tuple[float, float]:
    """The server's time-to-first-token histogram: (sum of seconds, count of requests)."""
    text = httpx.get(f"{server.base}/metrics").text
    values = [
        float(re.search(rf"^omni_pd_time_to_first_token_seconds_{part} (\S+)$", text, re.M).group(1))
        for part in ("sum", "count")
    ]
    return values[0], values[1]


def _first_chunk_problems(first: dict, first_chunk_s: float, first_token_s: float) -> list[str]:
    """Why a stream's first chunk would mislead a client that times the first token from it
    (vLLM's `bench serve --backend openai-chat`, OpenAI's SDK users): it must open the answer
    (the role), and arrive no earlier than the server's first token (its content may be "": a
    first token whose text is held back still sends, as vLLM's server does). [] when it does."""
    problems = []
    delta = ((first.get("choices") or [{}])[0].get("delta")) or {}
    if delta.get("role") != "assistant":
        problems.append(f"the first chunk has no role: {delta}")
    if first_chunk_s < first_token_s:
        problems.append(
            f"the first chunk came {first_chunk_s * 1e3:.1f} ms after the request, "
            f"before the server's first token ({first_token_s * 1e3:.1f} ms)"
        )
    return problems


def test_the_first_chunk_arrives_with_the_first_token(server):
    """A client that times TTFT from the first chunk reads the real first token, not the
    response headers (a role-only chunk read ~3 ms)."""
    ttft_before, count_before = _ttft_totals(server)
    start = time.perf_counter()
    stream = iter(
        _chat(
            server,
            "Stream this please.",
            max_tokens=16,
            temperature=0,
            stream=True,
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "pcm16"},
        )
    )
    first = next(stream)
    first_chunk_s = time.perf_counter() - start
    rest = list(stream)
    ttft_after, count_after = _ttft_totals(server)
    assert count_after == count_before + 1  # this request alone: its own first token
    first_token_s = ttft_after - ttft_before
    assert 0 < first_token_s and rest
    assert _first_chunk_problems(first.model_dump(), first_chunk_s, first_token_s) == []


def _token_chunks(chunks) -> list[str]:
    """The contents of a stream's chunks that carry a step's tokens: every chunk with a
    `content` key, "" included (a step whose text the server holds back), up to the finish."""
    return [
        c.choices[0].delta.content
        for c in chunks
        if c.choices and c.choices[0].delta.content is not None and c.choices[0].finish_reason is None
    ]


def test_a_held_back_first_token_still_opens_the_stream(server):
    """Issue 48, item 1: the first chunk leaves with the first token even when its text is held
    back, here because a stop string begins with it (it may still become the stop), and after it
    every step with a token sends a chunk: as many token chunks as tokens, the first one empty
    with the role, adding up to the answer. The control: the old rule (a chunk only for new
    text) sends one chunk fewer, and its first chunk comes with the second token."""
    first = _chat(server, "Hold the first one back.", max_tokens=1, temperature=0).choices[0].message.content
    stop = [(first or "") + "\x00never"]  # starts with the first token's text; never completes
    whole = _chat(server, "Hold the first one back.", max_tokens=8, temperature=0, stop=stop)
    chunks = list(
        _chat(server, "Hold the first one back.", max_tokens=8, temperature=0, stop=stop, stream=True)
    )
    tokens = whole.usage.completion_tokens
    contents = _token_chunks(chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and contents[0] == ""
    assert "".join(contents) == whole.choices[0].message.content, contents
    # A chunk per token step; one more at the end when text was held back to the last (half a
    # character, which the answer's text keeps as U+FFFD).
    assert tokens <= len(contents) <= tokens + 1, (contents, tokens)
    old_rule = [c for c in contents if c]  # the control
    assert len(old_rule) < tokens


# Hops that happen one after the other, across processes (issue 48 item 9): each (where, hop)
# at or after the one before it, on the host's one clock. P/D: prefill on stage 0, decode on 1.
PD_PATH = [
    ("client", "sent"),
    ("api server", "request in"),
    ("orchestrator", "arrived"),
    ("stage 0 (thinker)", "sent"),
    ("stage 0 (thinker)", "added"),
    ("stage 0 (thinker)", "prefill started"),
    ("stage 0 (thinker)", "kv published"),
    ("stage 0 (thinker)", "result out"),
    ("stage 0 (thinker)", "result in"),
    ("orchestrator", "text out"),
    ("api server", "first chunk out"),
    ("client", "first chunk in"),
]
DECODE_PATH = [
    ("stage 0 (thinker)", "result in"),
    ("stage 1 (thinker)", "sent"),
    ("stage 1 (thinker)", "added"),
    ("stage 1 (thinker)", "kv read started"),
    ("stage 1 (thinker)", "kv landed"),
    ("stage 1 (thinker)", "token 2"),
    ("stage 1 (thinker)", "result out"),
    ("stage 1 (thinker)", "result in"),
    ("api server", "last chunk out"),
    ("client", "last chunk in"),
]


def _out_of_order(rows: list[dict], path: list[tuple[str, str]]) -> list[str]:
    """Why `rows` (a timeline's hops) do not follow `path`: a hop missing, or one stamped
    before the hop ahead of it. [] when they do."""
    at = {(r["where"], r["hop"]): r["at_ms"] for r in rows}
    missing = [f"no {where!r} {hop!r}" for where, hop in path if (where, hop) not in at]
    if missing:
        return missing
    return [
        f"{a} at {at[a]:.3f} ms, after {b} at {at[b]:.3f} ms" for a, b in zip(path, path[1:]) if at[a] > at[b]
    ]


def test_a_traced_answer_carries_its_hops_in_the_order_they_happened(server):
    """`omni-pd serve --trace-hops`: the stream's last chunk carries the request's timeline,
    joined from the API server, the orchestrator and both P/D workers; put beside the client's
    own stamps (the same host's CLOCK_MONOTONIC), every hop of the request's path comes after
    the one before it, across four processes. The non-streamed answer carries it too."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Trace this one."}],
        "modalities": ["text"],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    first_in = last_in = None
    timeline = None
    with httpx.stream(
        "POST", f"{server.base}/v1/chat/completions", json=body, headers=server.headers, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                first_in = first_in or time.perf_counter()
                last_in = time.perf_counter()
                timeline = json.loads(line[len("data: ") :]).get("omni_pd_timeline", timeline)
    assert timeline is not None and first_in is not None
    offset = (timeline["origin"] - sent) * 1e3
    rows = [{"where": r["where"], "hop": r["hop"], "at_ms": r["at_ms"] + offset} for r in timeline["hops"]]
    rows += [
        {"where": "client", "hop": hop, "at_ms": (at - sent) * 1e3}
        for hop, at in (("sent", sent), ("first chunk in", first_in), ("last chunk in", last_in))
    ]
    assert _out_of_order(rows, PD_PATH) == [], rows
    assert _out_of_order(rows, DECODE_PATH) == [], rows
    # Another prompt: the decode leg's prefix cache would hold this one's blocks (no KV read).
    other = [{"role": "user", "content": "Trace this other one, whole."}]
    whole = httpx.post(
        f"{server.base}/v1/chat/completions",
        json={**body, "messages": other, "stream": False},
        headers=server.headers,
        timeout=120,
    ).json()
    assert _out_of_order(whole["omni_pd_timeline"]["hops"], PD_PATH[1:9] + DECODE_PATH[1:8]) == []


def test_the_hop_order_check_sees_a_missing_hop_and_one_out_of_order():
    """Negative control for the check above."""
    rows = [{"where": w, "hop": h, "at_ms": float(i)} for i, (w, h) in enumerate(PD_PATH)]
    assert _out_of_order(rows, PD_PATH) == []
    swapped = [dict(r) for r in rows]
    swapped[4]["at_ms"], swapped[5]["at_ms"] = swapped[5]["at_ms"], swapped[4]["at_ms"]
    assert len(_out_of_order(swapped, PD_PATH)) == 1
    assert _out_of_order(rows[:-1], PD_PATH) == ["no 'client' 'first chunk in'"]


def test_the_first_chunk_check_catches_an_early_empty_chunk():
    """Negative control for the check above: the role-only chunk sent before the prompt ran."""
    early = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    problems = _first_chunk_problems(early, first_chunk_s=0.003, first_token_s=0.020)
    assert len(problems) == 1 and "before" in problems[0]
    assert _first_chunk_problems(early, first_chunk_s=0.030, first_token_s=0.020) == []  # held back
    text = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}
    audio = {"choices": [{"index": 0, "delta": {"role": "assistant", "audio": {"data": "AAA="}}}]}
    assert _first_chunk_problems(text, 0.030, 0.020) == _first_chunk_problems(audio, 0.030, 0.020) == []
    assert _first_chunk_problems({"choices": [{"delta": {"content": "Hi"}}]}, 0.030, 0.020)


@pytest.mark.parametrize(
    "case",
    [
        "unknown_model",
        "empty_messages",
        "bad_modality",
        "bad_audio_format",
        "stream_wav",
        "temperature",
        "top_p",
        "max_tokens",
        "too_long",
        "bad_voice",
        "bad_part",
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    expect_status, param = 400, None
    if case == "unknown_model":
        kwargs["model"], expect_status, param = "gpt-nope", 404, "model"
    elif case == "empty_messages":
        kwargs["messages"], param = [], "messages"
    elif case == "bad_modality":
        kwargs["modalities"], param = ["image"], "modalities"
    elif case == "bad_audio_format":
        kwargs.update(modalities=["text", "audio"], audio={"voice": "ethan", "format": "mp3"})
        param = "audio.format"
    elif case == "stream_wav":  # OpenAI streams audio as pcm16 only
        kwargs.update(modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}, stream=True)
        param = "audio.format"
    elif case == "temperature":
        kwargs["temperature"], param = 5.0, "temperature"
    elif case == "top_p":
        kwargs["top_p"], param = 0.0, "top_p"
    elif case == "max_tokens":
        kwargs["max_tokens"], param = 0, "max_tokens"
    elif case == "too_long":
        kwargs["messages"], param = [{"role": "user", "content": "z" * 5000}], "messages"
    elif case == "bad_voice":
        kwargs.update(modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"})
        param = "audio.voice"
    elif case == "bad_part":
        kwargs["messages"] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        param = "messages[0].content[0].type"
    with pytest.raises(openai.APIStatusError) as err:
        server.client.chat.completions.create(**kwargs)
    assert err.value.status_code == expect_status
    body = err.value.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert body["param"] == param
    if case == "stream_wav":
        assert "pcm16" in body["message"] and "stream: false" in body["message"]
    assert _chat(server, "still there?", max_tokens=2).choices[0].message.content is not None


def _post(server, body: bytes, content_type="application/json", timeout=60) -> httpx.Response:
    return httpx.post(
        f"{server.base}/v1/chat/completions",
        content=body,
        timeout=timeout,
        headers={**server.headers, "content-type": content_type},
    )


def _openai_error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def _counter(server, outcome: str) -> float:
    found = re.search(
        rf'^omni_pd_requests_total{{outcome="{outcome}"}} (\S+)$',
        httpx.get(f"{server.base}/metrics").text,
        re.M,
    )
    return float(found.group(1)) if found else 0.0


def test_malformed_json_is_a_400(server):
    response = _post(server, b"{not json")
    assert response.status_code == 400
    assert _openai_error(response)["code"] == "invalid_json"


# Bodies as a hostile client writes them (raw bytes: a lone surrogate cannot go through a JSON
# encoder). Each is a 400 in OpenAI's shape naming the field; none reaches a stage.
OK_MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'
HOSTILE_BODIES = {
    "null_audio": (
        '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "input_audio", '
        '"input_audio": {"data": null, "format": "wav"}}]}]}',
        "messages[0].content[0].input_audio.data",
    ),
    "lone_surrogate": (
        '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages[0].content",
    ),
    "nan_temperature": ('{"model": "%s", ' + OK_MESSAGES + ', "temperature": NaN}', "temperature"),
    "tools": (
        '{"model": "%s", ' + OK_MESSAGES + ', "tools": [{"type": "function", "function": '
        '{"name": "get_weather", "parameters": {}}}]}',
        "tools",
    ),
    "logprobs": ('{"model": "%s", ' + OK_MESSAGES + ', "logprobs": true, "top_logprobs": 2}', "logprobs"),
    "n": ('{"model": "%s", ' + OK_MESSAGES + ', "n": 2}', "n"),
    "wrong_type": ('{"model": "%s", ' + OK_MESSAGES + ', "max_tokens": "ten"}', "max_tokens"),
    "wrong_nested_type": (
        '{"model": "%s", "messages": [{"role": "user", "content": 5}]}',
        "messages[0].content",
    ),
    "not_an_object": ('["%s"]', None),
    "missing_messages": ('{"model": "%s"}', "messages"),
}


@pytest.mark.parametrize("case", HOSTILE_BODIES)
def test_hostile_bodies_are_400s_naming_the_field(server, case):
    template, param = HOSTILE_BODIES[case]
    response = _post(server, (template % MODEL).encode())
    assert response.status_code == 400, response.text
    error = _openai_error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if case in ("tools", "logprobs", "n"):
        assert f"omni-pd does not support `{case}`" in error["message"]
        assert error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("case", ["invalid_utf8", "empty", "text_plain", "unknown_url"])
def test_every_body_and_route_error_is_in_openai_shape(server, case):
    if case == "invalid_utf8":
        response = _post(server, b'{"model": "x", "messages": [{"role": "user", "content": "\xff"}]}')
    elif case == "empty":
        response = _post(server, b"")
    elif case == "text_plain":
        response = _post(server, json.dumps({"model": MODEL}).encode(), content_type="text/plain")
    else:
        response = httpx.post(f"{server.base}/v1/chat/complete", json={}, headers=server.headers)
    assert response.status_code == (404 if case == "unknown_url" else 400)
    error = _openai_error(response)
    if case == "text_plain":
        assert "Content-Type: application/json" in error["message"]


def test_a_tiny_temperature_is_greedy_not_a_crash(server):
    greedy = _chat(server, "Tell me about the sea.", max_tokens=8, temperature=0)
    tiny = _chat(server, "Tell me about the sea.", max_tokens=8, temperature=1e-300)
    assert tiny.choices[0].message.content == greedy.choices[0].message.content
    assert tiny.usage.completion_tokens == 8


def test_api_key_guards_v1_but_not_health_or_metrics(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            response = httpx.request(method, f"{server.base}{path}", headers=headers, json={})
            assert response.status_code == 401, (headers, path)
            assert _openai_error(response)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert httpx.get(f"{server.base}/metrics").status_code == 200
    # The right key: the module's client sends it (every other test here), and so does a header.
    assert httpx.get(f"{server.base}/v1/models", headers=server.headers).status_code == 200


def _health_while(server, action) -> tuple[object, float, int]:
    """`action()`'s result, and the slowest of the GET /health answers polled meanwhile (each
    must be 200) and how many there were."""
    slowest, polls, done = 0.0, 0, threading.Event()
    result = {}

    def run():
        try:
            result["value"] = action()
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    while not done.is_set():
        start = time.monotonic()
        assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200
        slowest, polls = max(slowest, time.monotonic() - start), polls + 1
        time.sleep(0.02)
    thread.join()
    return result.get("value"), slowest, polls


def test_a_body_over_the_limit_is_a_413_at_once_and_health_keeps_answering(server):
    big = b'{"model": "%s", "messages": [], "pad": "' % MODEL.encode() + b"a" * (40 << 20) + b'"}'

    def chunked():  # no Content-Length: the server counts the body as it comes
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]
            time.sleep(0.005)

    for body in (big, chunked):
        start = time.monotonic()
        response, slowest, polls = _health_while(
            server, lambda: _post(server, big if body is big else chunked())
        )
        assert response.status_code == 413, response.text[:200]
        error = _openai_error(response)
        assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
        assert time.monotonic() - start < 10 and slowest < 1.0, (time.monotonic() - start, slowest)
    assert polls > 0
    assert _chat(server, "still there?", max_tokens=2).choices[0].message.content is not None


def test_a_huge_prompt_is_refused_without_stalling_the_server(server):
    """A 15 MB text took 20 s to tokenize on the event loop, and /health waited as long: now its
    length is checked off the loop, on a bounded prefix."""
    body = json.dumps(
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "z " * 7_500_000}]}
    ).encode()
    start = time.monotonic()
    response, slowest, _ = _health_while(server, lambda: _post(server, body))
    assert response.status_code == 400 and _openai_error(response)["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 5 and slowest < 1.0, (time.monotonic() - start, slowest)


def test_eight_concurrent_requests_equal_offline(server, offline):
    prompts = [f"Request number {i}: say something different." for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: _chat(server, p, max_tokens=8, temperature=0), prompts))
    wants = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=8, seed=42), None, None])
    assert [r.choices[0].message.content for r in replies] == [w.text for w in wants]


def test_client_disconnect_mid_stream_frees_the_request(server):
    aborted = _counter(server, "aborted")
    with httpx.stream(
        "POST",
        f"{server.base}/v1/chat/completions",
        timeout=60,
        headers=server.headers,
        json={
            "model": MODEL,
            "stream": True,
            "max_tokens": 2000,
            "temperature": 0,
            "messages": [{"role": "user", "content": "a long answer please"}],
        },
    ) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    # The connection is closed; the no_leaks fixture waits for every count to return to zero.
    wait_for(lambda: _counter(server, "aborted") == aborted + 1, 30, "the abort to be counted")
    assert _chat(server, "next", max_tokens=2).choices[0].message.content is not None


def test_client_gone_before_a_non_streamed_answer_aborts_and_counts_it(server):
    aborted, success = _counter(server, "aborted"), _counter(server, "success")
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # 2000 tokens take far longer than the client waits
        _post(
            server,
            json.dumps(
                {
                    "model": MODEL,
                    "max_tokens": 2000,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "a long answer please"}],
                }
            ).encode(),
            timeout=1.0,
        )
    # Aborted in every stage (no_leaks checks the counts) well before 2000 tokens would be done.
    wait_for(lambda: _counter(server, "aborted") == aborted + 1, 30, "the abort to be counted")
    assert time.monotonic() - start < 10 and _counter(server, "success") == success


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_sigterm_or_ctrl_c_shuts_down_cleanly_with_no_worker_left(signum):
    srv = Server()
    pids = srv.state()["worker_pids"]
    assert len(pids) == 4 and all(alive(p) for p in pids)
    srv.proc.send_signal(signum)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status names it.
    assert srv.proc.wait(60) in (0, -signum)
    log = srv.log_text()
    srv.stop()
    assert "all stages stopped" in log and "Application shutdown complete" in log
    assert not any(alive(p) for p in pids)


def _short_deadline_command(port: int) -> list[str]:
    return [*omni_pd_serve_command(port)[:-2], "--request-timeout", "2"]


def test_deadline_is_a_504_and_a_dead_stage_comes_back():
    srv = Server(_short_deadline_command)
    try:
        # 3000 tokens take the tiny thinker far longer than the 2 s deadline.
        with pytest.raises(openai.APIStatusError) as err:
            _chat(srv, "go on and on", max_tokens=3000, temperature=0)
        assert err.value.status_code == 504
        error = err.value.response.json()["error"]
        assert error["type"] == "timeout" and "stage 1 (thinker)" in error["message"], error
        # The timed-out request was aborted in its worker: the next one is served in time.
        assert _chat(srv, "short", max_tokens=2).usage.completion_tokens == 2
        wait_for(
            lambda: all(v == 0 for v in srv.state()["counts"].values()),
            30,
            "every per-request count to return to zero after the timeout",
        )

        talker_pid = srv.state()["worker_pids"][2]
        os.kill(talker_pid, signal.SIGKILL)
        killed = time.monotonic()

        # /health names the stage while it is restarting. Before that it may for a moment show
        # the talker "up" but not responsive ("has just exited"): the reader has not yet polled.
        def restarting() -> httpx.Response | None:
            health = httpx.get(f"{srv.base}/health", timeout=5)
            return health if health.json()["stages"]["2"]["status"] == "restarting" else None

        health = wait_for(restarting, 10, "GET /health to name the talker as restarting", 0.05)
        assert health.status_code == 503
        talker = health.json()["stages"]["2"]
        assert not talker["responsive"], talker
        assert "SIGKILL" in talker["reason"], talker
        # ... text alone does not need the talker: served meanwhile ...
        assert _chat(srv, "text only", max_tokens=2).usage.completion_tokens == 2
        # ... and the talker serves again within 10 s.
        wait_for(
            lambda: httpx.get(f"{srv.base}/health", timeout=5).status_code == 200,
            10,
            "GET /health to answer 200 after the restart",
        )
        reply = _chat(
            srv,
            "speak",
            max_tokens=2,
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"},
        )
        assert reply.choices[0].message.audio.data
        assert time.monotonic() - killed < 15
        metrics = httpx.get(f"{srv.base}/metrics").text
        assert 'omni_pd_stage_restarts_total{stage="2",stage_name="talker"} 1.0' in metrics
        assert "restarting it in" in srv.log_text()  # the WARNING a deployer sees
    finally:
        srv.stop()


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, non-streamed and streamed, and the
    prefix cache counters on /metrics."""
    system = {"role": "system", "content": "You are a patient teacher of geography. " * 4}
    first = [system, {"role": "user", "content": "Name a river."}]
    second = first + [
        {"role": "assistant", "content": "The Nile."},
        {"role": "user", "content": "And a mountain?"},
    ]
    cold = server.client.chat.completions.create(model=MODEL, messages=first, max_tokens=4)
    assert cold.usage.prompt_tokens_details.cached_tokens % 16 == 0
    warm = server.client.chat.completions.create(model=MODEL, messages=second, max_tokens=4)
    # The system prompt and the first turn, in whole 16-token blocks, came from the cache.
    assert warm.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens - 16
    assert warm.usage.prompt_tokens_details.cached_tokens < warm.usage.prompt_tokens
    stream = server.client.chat.completions.create(
        model=MODEL, messages=second, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens >= warm.usage.prompt_tokens_details.cached_tokens

    def total(name: str, text: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name}{{"))

    def scraped_with_hits() -> str | None:
        text = httpx.get(f"{server.base}/metrics").text
        return text if total("omni_pd_prefix_cache_hits_total", text) > 0 else None

    # The engines' counters reach /metrics with their heartbeats (every 0.5 s).
    text = wait_for(scraped_with_hits, 10, "the prefix cache hits on /metrics")
    assert (
        total("omni_pd_prefix_cache_queries_total", text)
        >= total("omni_pd_prefix_cache_hits_total", text)
        > 0
    )


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server):
    """vLLM's `stream_options.continuous_usage_stats` (vllm-omni's benchmark client asks for it
    and counts tokens from it): every chunk carries the usage so far, its completion tokens
    never fall, the first chunk already counts the first token, and the last equals the usage
    chunk's. Without the option, no chunk but the usage chunk carries usage."""
    messages = [{"role": "user", "content": "Count the waves."}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, stream=True, stream_options=options
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts[0] >= 1 and counts == sorted(counts) and counts[-1] == 6
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    plain = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    assert [c.usage is not None for c in plain][-2:] == [False, True]


def test_the_grafana_dashboard_queries_what_this_server_exports(server):
    """examples/grafana_dashboard.json against a live P/D server's /metrics, after the requests
    above: every metric name and label its queries use is exported (dashboard_check.py; its
    negative controls are in tests/test_server_metrics.py)."""
    list(
        _chat(
            server,
            "one more for the dashboard",
            max_tokens=4,
            stream=True,
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "pcm16"},
        )
    )
    exposition = Exposition.parse(httpx.get(f"{server.base}/metrics").text)
    # Per-stage series are labelled by id and name apart (they read stage="0:thinker prefill").
    assert exposition.labels["omni_pd_stage_up"] == {"stage", "stage_name"}
    assert problems(load_dashboard(), exposition) == []
