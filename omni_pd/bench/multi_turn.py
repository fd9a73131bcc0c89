"""Multi-turn conversations for `omni-pd bench serve --multi-turn K`.

Each conversation starts from a long system prompt; every turn sends the whole history (the
system prompt, the earlier user turns and the answers the server gave) plus a new user turn, as
a voice client does. With `--audio-turns` each user turn also carries a clip (a seeded synthetic
WAV, as an `input_audio` part), so the history resends audio too. Conversations run one after another, so a turn's time to first token is its
prefill and overheads, not queueing. The report gives, per turn index, TTFT and TTFA
percentiles, the prompt length and the prompt tokens the server says it served from its prefix
cache (`usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import base64
import io
from typing import Any, Awaitable, Callable, Sequence

import numpy as np
import soundfile

from .load import stream_one
from .stats import RequestRecord, percentiles_ms, ratio

# About 1,700 characters: with the tiny model's byte-level tokenizer, as many prompt tokens.
SYSTEM_PROMPT = (
    "You are a calm, friendly voice assistant for travellers. Answer in one or two "
    "short sentences, plainly, without lists or markup, and ask back when a question "
    "is unclear. "
) * 9
USER_TURNS = (
    "Where should I go first in Lisbon?",
    "And how do I get there from the airport?",
    "Is it safe to walk there at night?",
    "What should I eat nearby?",
    "How much does that usually cost?",
    "Can you say that again more slowly?",
    "What is the weather like in spring?",
    "Thank you, one last question: trams?",
)


AUDIO_SAMPLE_RATE = 16_000


def spoken_clip(conversation: int, turn: int, seconds: float = 1.0) -> dict:
    """An `input_audio` part: `seconds` of a seeded chord with noise, as a 16 kHz PCM16 WAV,
    distinct per conversation and turn."""
    rng = np.random.default_rng(1000 * conversation + turn)
    t = np.arange(int(seconds * AUDIO_SAMPLE_RATE)) / AUDIO_SAMPLE_RATE
    wave = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(120, 900, size=3))
    samples = (0.2 * wave + 0.02 * rng.standard_normal(t.size)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, AUDIO_SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(), "format": "wav"},
    }


def conversation_turn(history: list[dict], turn: int, clip: dict | None = None) -> list[dict]:
    text = USER_TURNS[turn % len(USER_TURNS)]
    content = [{"type": "text", "text": text}, clip] if clip else text
    return history + [{"role": "user", "content": content}]


def _text_chars(messages: list[dict]) -> int:
    return sum(
        len(m["content"])
        if isinstance(m["content"], str)
        else sum(len(p.get("text", "")) for p in m["content"])
        for m in messages
    )


async def run_conversations(
    client: Any,
    model: str,
    turns: int,
    conversations: int,
    max_tokens: int,
    system_prompt: str = SYSTEM_PROMPT,
    on_done: Callable[[RequestRecord], None] | None = None,
    audio_seconds: float | None = None,
    send: Callable[..., Awaitable[RequestRecord]] = stream_one,
) -> list[list[tuple[RequestRecord, int]]]:
    """`conversations` conversations of `turns` turns, one after another: per turn index, each
    conversation's (record, prompt text characters). A conversation whose turn fails stops
    there. `audio_seconds`: each user turn carries a clip that long. `send`: how a turn is
    sent (stream_one, or it asking for text alone)."""
    by_turn: list[list[tuple[RequestRecord, int]]] = [[] for _ in range(turns)]
    for number in range(conversations):
        # A conversation of its own: its first words differ, so nothing but its own history
        # (and the shared system prompt) can be cached for it.
        history = [{"role": "system", "content": f"Conversation {number}. {system_prompt}"}]
        for turn in range(turns):
            clip = spoken_clip(number, turn, audio_seconds) if audio_seconds else None
            messages = conversation_turn(history, turn, clip)
            record = await send(client, model, messages, max_tokens)
            by_turn[turn].append((record, _text_chars(messages)))
            if on_done:
                on_done(record)
            if not record.ok:
                break
            history = messages + [{"role": "assistant", "content": record.text}]
    return by_turn


def summarize_turns(config: str, by_turn: Sequence[Sequence[tuple[RequestRecord, int]]]) -> list[dict]:
    rows = []
    for turn, entries in enumerate(by_turn):
        done = [r for r, _ in entries if r.ok]
        row: dict = {
            "config": config,
            "turn": turn + 1,
            "num_requests": len(entries),
            "errors": len(entries) - len(done),
        }
        row["ttft_ms_p50"], row["ttft_ms_p99"] = percentiles_ms([r.ttft_s for r in done])
        row["ttfa_ms_p50"], row["ttfa_ms_p99"] = percentiles_ms([r.ttfa_s for r in done if not r.no_speech])
        row["prompt_chars_mean"] = (sum(c for r, c in entries if r.ok) / len(done)) if done else None
        cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
        row["cached_tokens_mean"] = sum(cached) / len(cached) if cached else None
        rows.append(row)
    return rows


def uncached_twins(labels: set[str]) -> dict[str, str]:
    """Each config label whose twin with the prefix cache off was measured too: PATH's twin is
    PATH@prefix_caching=false, and so is PATH@prefix_caching=true's (a file whose thinker has
    the cache off by default, as a vLLM thinker has)."""
    twins = {label: f"{label.removesuffix('@prefix_caching=true')}@prefix_caching=false" for label in labels}
    return {label: twin for label, twin in twins.items() if twin in labels and twin != label}


def add_uncached_ratios(rows: list[dict], pairs: dict[str, str]) -> None:
    """`ttft_vs_uncached` / `ttfa_vs_uncached`: a config's p50 against the same config with
    prefix caching off (`pairs`: cached label -> uncached label), at the same turn."""
    by_key = {(r["config"], r["turn"]): r for r in rows}
    for row in rows:
        base = by_key.get((pairs.get(row["config"]), row["turn"]))
        if base is not None:
            row["ttft_vs_uncached"] = ratio(row["ttft_ms_p50"], base["ttft_ms_p50"])
            row["ttfa_vs_uncached"] = ratio(row["ttfa_ms_p50"], base["ttfa_ms_p50"])
