"""The bench's chat client: streamed chat completions read the way vLLM's and vllm-omni's
benchmark clients read them (aiohttp, the server-sent events split by hand, each payload a JSON
dict stamped as its event arrives), not through the `openai` SDK.

Why not the SDK: it turns every chunk into typed objects. On the 2-core host a 32-token spoken
answer cost its client ~15-22 ms of CPU that way, against ~7 ms read by hand, and the client
shares those cores with the server: the SDK's first audio read ~5-8 ms later than vllm-omni's
client on the same server and prompts (issue 48, item 8). The SDK still lists models and drives
the Realtime API (`BenchClient.sdk`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator


class ChatStreamError(Exception):
    """A chat request the server refused (`status_code`: its HTTP status) or failed mid-stream
    (an `error` event; `status_code` None)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class EventReader:
    """Server-sent events from a byte stream read in pieces that can end anywhere, even inside
    `data: `: `feed` returns the data of each event the piece completes (an event's `data:`
    lines joined by newlines, as the SSE standard joins them; events without data, such as the
    comment `: ping`, give none)."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, piece: bytes) -> list[str]:
        # CRLF line ends normalised first; a CR ending one piece waits with its LF in the next.
        events = (self.pending + piece).replace(b"\r\n", b"\n").split(b"\n\n")
        self.pending = events.pop()
        found = []
        for event in events:
            lines = [line for line in event.decode("utf-8").split("\n") if line.startswith("data:")]
            if lines:
                found.append("\n".join(line[6:] if line.startswith("data: ") else line[5:] for line in lines))
        return found


# A kept connection idle this long is closed by the client, not reused. uvicorn (omni-pd's and
# vLLM's server) closes one idle for 5 s; aiohttp's own default, 15 s, let a request go out on a
# connection the server was closing at that moment ("Can not write request body").
IDLE_CONNECTION_S = 3.0


class ChatStreamer:
    """POSTs streamed chat completions to `base_url`/v1/chat/completions on one aiohttp session
    (opened on the first request, in the running event loop) and yields `(arrival, payload)` per
    event until `[DONE]`, `arrival` the perf_counter time of the read that completed the event.
    `timeout_s`: the most one request may take, start to end. `keep_alive` False: a new
    connection per request, as vllm-omni's benchmark client makes them (its connector's
    `force_close`); vLLM's client and the openai SDK keep theirs, each closed once idle for
    `idle_s` (`IDLE_CONNECTION_S`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        timeout_s: float,
        keep_alive: bool = True,
        idle_s: float = IDLE_CONNECTION_S,
    ) -> None:
        self.url = f"{base_url.rstrip('/')}/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.timeout_s = timeout_s
        self.keep_alive = keep_alive
        self.idle_s = idle_s
        self._session: Any = None

    async def stream(self, body: dict) -> AsyncIterator[tuple[float, dict]]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=(
                    aiohttp.TCPConnector(keepalive_timeout=self.idle_s)
                    if self.keep_alive
                    else aiohttp.TCPConnector(force_close=True)
                ),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        async with self._session.post(self.url, json=body, headers=self.headers) as response:
            if response.status != 200:
                text = (await response.text())[:500]
                raise ChatStreamError(f"HTTP {response.status}: {text}", response.status)
            reader = EventReader()
            async for piece in response.content.iter_any():
                arrival = time.perf_counter()  # the events a read completes arrived together
                for data in reader.feed(piece):
                    if data == "[DONE]":
                        return
                    payload = json.loads(data)
                    if payload.get("error") is not None:
                        error = payload["error"]
                        raise ChatStreamError(
                            str(error.get("message", error) if isinstance(error, dict) else error)
                        )
                    yield arrival, payload

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass
class BenchClient:
    """What a bench level sends through: `chat` streams chat completions; `sdk` (an
    `openai.AsyncOpenAI`) lists the server's models and opens Realtime sessions."""

    sdk: Any
    chat: ChatStreamer

    async def close(self) -> None:
        await self.chat.close()
        await self.sdk.close()
