"""`omni-pd bench serve --realtime`: each closed-loop level runs twice, through the chat endpoint
(streamed) and through the Realtime API, with the same prompts; a realtime row's
`ttfa_vs_chat` is its TTFA p50 over the chat row's at the same level, in the same run.

A realtime request is one turn of a live session: the socket is opened and the session set up
first (a conversation pays that once, not per turn), then the clock starts as the user's turn
is sent (`conversation.item.create`, then `response.create`): TTFT at the first transcript
delta, TTFA at the first `response.output_audio.delta`, e2e at `response.done`.
"""

from __future__ import annotations

import time
from typing import Any

from .load import VOICE
from .stats import RequestRecord, ratio


async def realtime_one(client: Any, model: str, prompt: str | list[dict], max_tokens: int) -> RequestRecord:
    if not isinstance(prompt, str):
        raise ValueError("the realtime driver sends one user text turn")
    ttft = ttfa = None
    pieces: list[str] = []
    try:
        async with client.sdk.realtime.connect(model=model) as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "max_output_tokens": max_tokens,
                    "audio": {"input": {"turn_detection": None}, "output": {"voice": VOICE}},
                }
            )
            async for event in conn:
                if event.type == "error":
                    raise RuntimeError(event.error.message)
                if event.type == "session.updated":
                    break
            sent = time.perf_counter()
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}
            )
            await conn.response.create()
            async for event in conn:
                now = time.perf_counter()
                if event.type == "error":
                    raise RuntimeError(event.error.message)
                if event.type == "response.output_audio_transcript.delta":
                    pieces.append(event.delta)
                    ttft = ttft if ttft is not None else now - sent
                elif event.type == "response.output_audio.delta" and ttfa is None:
                    ttfa = now - sent
                elif event.type == "response.done":
                    response = event.response
                    if response.status not in ("completed", "incomplete"):
                        details = response.status_details
                        raise RuntimeError(
                            f"response {response.status}: {getattr(details, 'error', None) or details}"
                        )
                    tokens = response.usage.output_tokens if response.usage else len(pieces)
                    return RequestRecord(
                        ok=True,
                        no_speech=ttfa is None,
                        ttft_s=ttft,
                        ttfa_s=ttfa,
                        e2e_s=now - sent,
                        output_tokens=tokens,
                        text="".join(pieces),
                    )
        return RequestRecord(ok=False, error="the socket closed before response.done")
    except Exception as exc:  # counted, the level goes on
        return RequestRecord(ok=False, error=f"{type(exc).__name__}: {exc}")


def add_vs_chat(rows: list[dict]) -> None:
    """`ttfa_vs_chat` / `ttft_vs_chat` on each realtime row: against the chat row of the same
    config and level."""
    chat = {(r["config"], r["concurrency"]): r for r in rows if r.get("endpoint") == "chat"}
    for row in rows:
        base = chat.get((row.get("chat_config"), row["concurrency"]))
        if row.get("endpoint") == "realtime" and base is not None:
            row["ttfa_vs_chat"] = ratio(row["ttfa_ms_p50"], base["ttfa_ms_p50"])
            row["ttft_vs_chat"] = ratio(row["ttft_ms_p50"], base["ttft_ms_p50"])
