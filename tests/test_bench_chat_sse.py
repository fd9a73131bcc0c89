"""The bench's chat client (omni_pd/bench/chat_sse.py), which reads the server-sent events itself
as vLLM's and vllm-omni's benchmark clients do: the same payloads however the bytes are cut, and
a refusal or a failure mid-stream is one error a level counts."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from aiohttp import web

from omni_pd.bench.chat_sse import BenchClient, ChatStreamer, ChatStreamError, EventReader
from omni_pd.bench.load import stream_one

PAYLOADS = [
    {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}], "modality": "text"},
    {"choices": [{"delta": {"content": "Hé llo\n"}, "finish_reason": None}], "modality": "text"},
    {"choices": [{"delta": {"audio": {"data": "AAAA" * 500}}, "finish_reason": None}], "modality": "audio"},
    {"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}], "modality": "text"},
    {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}},
]


def _wire(payloads: list[dict], crlf: bool = False) -> bytes:
    text = ": ping\n\n" + "".join(f"data: {json.dumps(p, ensure_ascii=False)}\n\n" for p in payloads)
    text += "data: [DONE]\n\n"
    return (text.replace("\n", "\r\n") if crlf else text).encode()


def _read(wire: bytes, cuts: list[int]) -> list[str]:
    reader, found, start = EventReader(), [], 0
    for cut in sorted(cuts) + [len(wire)]:
        found += reader.feed(wire[start:cut])
        start = cut
    assert reader.pending == b""
    return found


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
def test_events_are_the_same_however_the_bytes_are_cut(crlf):
    wire = _wire(PAYLOADS, crlf)
    want = [json.dumps(p, ensure_ascii=False) for p in PAYLOADS] + ["[DONE]"]
    assert _read(wire, []) == want  # the comment gives nothing
    for cut in range(1, len(wire)):  # every single cut: inside `data: `, the JSON, é, the blank line
        assert _read(wire, [cut]) == want, cut
    rng = random.Random(0)
    for _ in range(200):  # many cuts at once, a byte apart at times
        assert _read(wire, rng.sample(range(1, len(wire)), rng.randint(2, 40))) == want


def test_multi_line_data_is_joined_and_an_unfinished_event_waits():
    reader = EventReader()
    assert reader.feed(b'data: {"a":\ndata: 1}\n\ndata: {"b"') == ['{"a":\n1}']
    assert reader.feed(b": 2}\n") == []  # no blank line yet: not an event
    assert reader.feed(b"\n") == ['{"b": 2}']


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _streaming(wire: bytes, pieces: int = 7):
    async def handler(request):
        assert request.headers["Authorization"] == "Bearer sk-test"
        body = await request.json()
        assert body["stream"] is True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        step = max(1, len(wire) // pieces)
        for start in range(0, len(wire), step):
            await response.write(wire[start : start + step])
        await response.write_eof()
        return response

    return handler


def _run(handler, body: dict | None = None, send=None):
    async def main():
        runner, base = await _serve(handler)
        chat = ChatStreamer(base, "sk-test", timeout_s=30)
        try:
            if send is not None:
                return await send(BenchClient(sdk=None, chat=chat))
            return [payload async for _, payload in chat.stream(body or {"stream": True})]
        finally:
            await chat.close()
            await runner.cleanup()

    return asyncio.run(main())


def test_a_live_stream_gives_every_payload_and_the_bench_reads_it():
    assert _run(_streaming(_wire(PAYLOADS))) == PAYLOADS
    record = _run(_streaming(_wire(PAYLOADS)), send=lambda client: stream_one(client, "m", "hi", 8))
    assert record.ok and record.text == "Hé llo\n" and record.output_tokens == 2 and record.prompt_tokens == 5
    assert record.ttfa_s is not None and record.audio_s == pytest.approx(1500 / 2 / 24_000)


def test_a_refusal_is_an_error_with_its_status_and_a_429_is_counted_as_rejected():
    async def busy(request):
        return web.json_response({"error": {"message": "the queue is full"}}, status=429)

    with pytest.raises(ChatStreamError, match="HTTP 429: .*the queue is full") as refused:
        _run(busy)
    assert refused.value.status_code == 429
    record = _run(busy, send=lambda client: stream_one(client, "m", "hi", 8))
    assert not record.ok and record.rejected and "429" in record.error


def test_an_error_event_mid_stream_fails_the_request_with_its_message():
    wire = _wire(PAYLOADS[:2] + [{"error": {"message": "the talker died", "code": 500}}])
    with pytest.raises(ChatStreamError, match="the talker died") as failed:
        _run(_streaming(wire))
    assert failed.value.status_code is None
    record = _run(_streaming(wire), send=lambda client: stream_one(client, "m", "hi", 8))
    assert not record.ok and not record.rejected and "the talker died" in record.error


def _client_ports(requests: int, pause_s: float = 0.0, **streamer) -> list[int]:
    """The client port the server saw for each of `requests` streamed requests sent one after
    another on one ChatStreamer(**streamer), `pause_s` idle after each."""
    ports: list[int] = []
    handler = _streaming(_wire(PAYLOADS))

    async def counting(request):
        ports.append(request.transport.get_extra_info("peername")[1])
        return await handler(request)

    async def main():
        runner, base = await _serve(counting)
        chat = ChatStreamer(base, "sk-test", timeout_s=30, **streamer)
        try:
            for _ in range(requests):
                assert [p async for _, p in chat.stream({"stream": True})] == PAYLOADS
                await asyncio.sleep(pause_s)  # the idle time under test, not a synchronisation
        finally:
            await chat.close()
            await runner.cleanup()

    asyncio.run(main())
    return ports


@pytest.mark.parametrize("keep_alive", [True, False])
def test_connections_are_kept_unless_asked_for_one_per_request(keep_alive):
    """Kept, as vLLM's client and the openai SDK keep them; one per request (`--no-keep-alive`),
    as vllm-omni's client opens them: the server sees one client port, or one per request."""
    ports = _client_ports(3, keep_alive=keep_alive)
    assert len(ports) == 3 and len(set(ports)) == (1 if keep_alive else 3)


def test_a_connection_idle_past_the_clients_limit_is_not_reused():
    """A kept connection idle longer than `idle_s` is dropped by the client: the next request
    opens a new one (the server sees a second port), so no request is written to a connection
    the server's own idle limit (uvicorn's 5 s) is closing. Control: within the limit it is
    reused."""
    ports = _client_ports(2, pause_s=0.3, idle_s=0.05)
    assert len(ports) == 2 and ports[0] != ports[1]
    ports = _client_ports(2, pause_s=0.3, idle_s=30)
    assert len(ports) == 2 and ports[0] == ports[1]
