"""The load driver: streaming chat completions (text and audio) through the bench's chat client
(`chat_sse.BenchClient`), `concurrency` requests in flight until `n` are done, each timed from
the moment it is sent."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import random
import time
import wave
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from .stats import RequestRecord

# Varied short user prompts; request i of a level sends PROMPTS[i % len(PROMPTS)].
PROMPTS = (
    "Tell me about the sea.",
    "What is the capital of France?",
    "Say hello in three languages.",
    "Describe a sunset in one sentence.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What rhymes with orange?",
    "Count from one to five.",
    "Name a famous painting.",
    "How do bees make honey?",
    "Write a haiku about rain.",
    "What time zone is Tokyo in?",
    "Explain gravity to a child.",
    "Suggest a name for a cat.",
    "What is two plus two?",
    "Recommend a book for a long flight.",
)
VOICE = "ethan"
# The OpenAI form's streamed audio: base64 pcm16, mono, 24 kHz (OpenAI's Realtime and chat rate).
PCM16_RATE = 24_000


def audio_seconds(data: str, wav: bool) -> float:
    """The length of one streamed audio piece: base64 pcm16 at 24 kHz (OpenAI's form), or a
    base64 WAV file (vllm-omni's form: its header gives rate, width and channels). A piece that
    does not decode counts 0."""
    try:
        raw = base64.b64decode(data)
    except (binascii.Error, ValueError):
        return 0.0
    if not wav:
        return len(raw) / 2 / PCM16_RATE
    try:
        with wave.open(io.BytesIO(raw), "rb") as piece:
            return piece.getnframes() / float(piece.getframerate())
    except (wave.Error, EOFError):
        return 0.0


def _output(text_only: bool) -> dict[str, Any]:
    """The request's output keys: text alone, or text and streamed speech."""
    if text_only:
        return {"modalities": ["text"]}
    return {"modalities": ["text", "audio"], "audio": {"voice": VOICE, "format": "pcm16"}}


@dataclass
class _Reading:
    """What one streamed answer showed so far, chunk by chunk (`stream_one` times it)."""

    sent: float
    ttft: float | None = None
    ttfa: float | None = None
    last_audio: float | None = None
    audio_s: float = 0.0
    content_times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    usage_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None

    def usage(self, usage: dict | None) -> None:
        if not usage or usage.get("completion_tokens") is None:
            return
        self.usage_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = int(usage["prompt_tokens"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            self.cached_tokens = int(cached)

    def add(self, chunk: dict, now: float) -> None:
        """One streamed chunk (its JSON payload), arrived at `now`."""
        self.usage(chunk.get("usage"))
        if not chunk.get("choices"):
            return
        choice = chunk["choices"][0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if chunk.get("modality") == "audio" and content:  # vllm-omni's form: a WAV piece
            audio, wav = content, True
        else:
            audio, wav = (delta.get("audio") or {}).get("data"), False
            # A finish chunk's "" (omni-pd opens an empty answer with it) is no token.
            if content is not None and (content or not choice.get("finish_reason")):
                self.pieces.append(content)
                self.content_times.append(now)
                if self.ttft is None:
                    self.ttft = now - self.sent
        if audio:
            self.ttfa = now - self.sent if self.ttfa is None else self.ttfa
            self.last_audio = now
            self.audio_s += audio_seconds(audio, wav)

    def record(self, ended: float, text_only: bool) -> RequestRecord:
        times = self.content_times
        return RequestRecord(
            ok=True,
            no_speech=self.ttfa is None and not text_only,
            ttft_s=self.ttft,
            ttfa_s=self.ttfa,
            rtf=(self.last_audio - self.sent) / self.audio_s
            if self.last_audio is not None and self.audio_s > 0
            else None,
            audio_s=self.audio_s,
            e2e_s=ended - self.sent,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            output_tokens=self.usage_tokens if self.usage_tokens is not None else len(times),
            text="".join(self.pieces),
            cached_tokens=self.cached_tokens,
            prompt_tokens=self.prompt_tokens,
        )


async def stream_one(
    client: Any, model: str, prompt: str | list[dict], max_tokens: int, text_only: bool = False
) -> RequestRecord:
    """One streaming request (`prompt`: a user message, or the whole list of messages). TTFT:
    first chunk with `delta.content` before the finish (content "" counts: the server sends one
    when a token exists whose text is held back, as vLLM's client counts it); TTFA: first chunk
    with audio data; RTF (vllm-omni's audio RTF): the last audio chunk's time over the seconds of
    audio streamed; ITL: gaps between consecutive content chunks; e2e: until the stream ends;
    output tokens: `usage.completion_tokens` when sent, else the number of content chunks.
    A request that raises is an error (`ok` False); a server that fails a request mid-stream
    sends an error event, which the client raises. A stream that ends normally without audio is
    an answer with nothing to speak (the thinker's end token first, or, with random weights, the
    talker's codec end first): complete, with `no_speech`, and counted apart. `text_only`: the
    request asks for text alone (`modalities: ["text"]`), and has no TTFA. Audio in vllm-omni's
    form (`omni-pd serve --stream-audio-form vllm-omni`: a WAV in `delta.content` of a chunk whose
    `modality` is "audio") is read as audio, not as text."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        **_output(text_only),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reading = _Reading(sent=time.perf_counter())
    try:
        async for now, chunk in client.chat.stream(body):
            reading.add(chunk, now)
        ended = time.perf_counter()
    except Exception as exc:  # counted, the level goes on
        return RequestRecord(
            ok=False, rejected=getattr(exc, "status_code", None) == 429, error=f"{type(exc).__name__}: {exc}"
        )
    if reading.finish_reason is None:
        return RequestRecord(ok=False, error="the stream ended without a finish_reason")
    return reading.record(ended, text_only)


def nth(max_tokens: int | Sequence[int], index: int) -> int:
    """Request `index`'s max_tokens: the one for all, or its own (a mixed-length workload)."""
    return max_tokens if isinstance(max_tokens, int) else max_tokens[index]


async def run_level(
    client: Any,
    model: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int | Sequence[int],
    prompts: Sequence[str] = PROMPTS,
    on_done: Callable[[RequestRecord], None] | None = None,
    send: Callable[..., Awaitable[RequestRecord]] = stream_one,
) -> tuple[list[RequestRecord], float]:
    """`num_requests` requests with exactly `concurrency` in flight (fewer only once fewer remain),
    each sent by `send` (the chat endpoint; bench/realtime.py has the Realtime API's), request i
    with `max_tokens` or its i-th entry. Returns the records in request order and the level's
    wall time in seconds."""
    records: list[RequestRecord | None] = [None] * num_requests
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < num_requests:
            index = next_index
            next_index += 1
            record = await send(client, model, prompts[index % len(prompts)], nth(max_tokens, index))
            records[index] = record
            if on_done:
                on_done(record)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
    return records, time.perf_counter() - began  # type: ignore[return-value]


def poisson_arrivals(rate: float, num_requests: int, seed: int) -> list[float]:
    """Send times (s from the start) of an open-loop Poisson process of `rate` requests/s:
    exponential gaps, the first request at 0, reproducible by `seed`."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run_open_loop(
    client: Any,
    model: str,
    rate: float,
    num_requests: int,
    max_tokens: int | Sequence[int],
    seed: int = 0,
    prompts: Sequence[str] = PROMPTS,
    on_done: Callable[[RequestRecord], None] | None = None,
    send: Callable[..., Awaitable[RequestRecord]] = stream_one,
) -> tuple[list[RequestRecord], float]:
    """`num_requests` requests sent by `send` at Poisson arrival times whatever is in flight
    (vLLM's `--request-rate`): the offered load does not wait for the server, so a server past
    its capacity shows it in its latencies. Request i has `max_tokens` or its i-th entry. Returns
    the records in request order and the wall time from the first send to the last answer."""
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def one(index: int, at: float) -> RequestRecord:
        delay = began + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself, not a wait for the server
        record = await send(client, model, prompts[index % len(prompts)], nth(max_tokens, index))
        if on_done:
            on_done(record)
        return record

    arrivals = poisson_arrivals(rate, num_requests, seed)
    records = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    return list(records), loop.time() - began
