"""One server measured by `omni-pd bench serve`: its closed-loop concurrency levels (and their
Realtime API twins), its open-loop request rates, or its multi-turn conversations; the prompts
they send and the KV handoff time the server reports."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

DEFAULT_NUM_REQUESTS, QUICK_NUM_REQUESTS = 16, 4
WAVES = 4  # default requests per level: WAVES x concurrency, at least DEFAULT_NUM_REQUESTS
DEFAULT_OPEN_LOOP_REQUESTS, QUICK_OPEN_LOOP_REQUESTS = 32, 8


def parse_rates(text: str | None) -> list[tuple[str, float, bool]]:
    """`--request-rate` as (label, value, relative): `8` is 8 req/s, `50%` half the capacity."""
    out = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        relative = part.endswith("%")
        try:
            value = float(part[:-1] if relative else part)
        except ValueError:
            value = -1.0
        if value <= 0:
            raise SystemExit(f"error: --request-rate takes positive numbers or percentages, got {part!r}")
        out.append((part, value / 100 if relative else value, relative))
    return out


async def _handoff_totals(base_url: str) -> tuple[float, float] | None:
    """(sum of seconds, count) of the server's KV handoff histogram, from GET /metrics; None
    when it cannot be read (an older server, a proxy)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"{base_url.rstrip('/')}/metrics")).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("omni_pd_kv_handoff_seconds_sum", "omni_pd_kv_handoff_seconds_count"):
            values[name] = float(value)
    if len(values) != 2:
        return None
    return values["omni_pd_kv_handoff_seconds_sum"], values["omni_pd_kv_handoff_seconds_count"]


def _mean_handoff_ms(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None  # no P/D handoff in this level (a colocated server)
    return (after[0] - before[0]) / (after[1] - before[1]) * 1e3


def _prompt_maker(args: argparse.Namespace, model: str) -> Callable[[int], Sequence[str]]:
    """`fresh(n)`: the next n prompts. Short varied ones by default (repeating); with
    --prompt-tokens, each of that many tokens and numbered on from the last (none repeats)."""
    from .load import PROMPTS

    if not args.prompt_tokens:
        return lambda n: [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    from .sized_prompts import load_tokenizer, sized_prompts

    tokenizer = load_tokenizer(args.model or model)
    made = 0

    def fresh(n: int) -> Sequence[str]:
        nonlocal made
        made += n
        return sized_prompts(tokenizer, args.prompt_tokens, n, first=made - n)

    return fresh


async def bench_target(
    base_url: str,
    label: str,
    model: str | None,
    levels: list[int],
    args: argparse.Namespace,
    num_requests: int | None,
    errors: dict[str, list[str]],
) -> tuple[str, list[dict], list[dict], list[dict]]:
    """Every level against one server; returns the model name used, one row per closed-loop
    level, one per open-loop rate, and (--multi-turn) one per turn."""
    import openai

    # The servers it starts inherit OMNI_PD_API_KEY (and a --base-url server may need it too).
    client = openai.AsyncOpenAI(
        base_url=f"{base_url.rstrip('/')}/v1",
        api_key=os.environ.get("OMNI_PD_API_KEY") or "unused",
        max_retries=0,
        timeout=args.request_timeout,
    )
    rows, open_rows, turn_rows = [], [], []
    try:
        if model is None:
            listed = await client.models.list()
            model = listed.data[0].id
        fresh = _prompt_maker(args, model)
        if args.multi_turn:
            turn_rows = await _bench_multi_turn(client, model, label, args, errors)
            levels = []  # conversations instead of the levels
        for concurrency in levels:
            rows += await _bench_level(
                client, model, base_url, label, concurrency, args, num_requests, errors, fresh
            )
        open_rows = await _bench_open_loop(client, model, label, args, rows, errors, fresh)
    finally:
        await client.close()
    return model, rows, open_rows, turn_rows


def _slos(args: argparse.Namespace) -> dict[str, float | None]:
    return {"slo_ttft_ms": args.slo_ttft_ms, "slo_ttfa_ms": args.slo_ttfa_ms, "slo_itl_ms": args.slo_itl_ms}


async def _bench_multi_turn(
    client, model: str, label: str, args: argparse.Namespace, errors: dict[str, list[str]]
) -> list[dict]:
    """--multi-turn: the warm-up requests, then the conversations; one row per turn."""
    from tqdm import tqdm

    from .load import PROMPTS, stream_one
    from .multi_turn import run_conversations, summarize_turns

    for i in range(args.warmup):
        await stream_one(client, model, PROMPTS[i % len(PROMPTS)], args.max_tokens)
    count = args.conversations or (2 if args.quick else 4)
    with tqdm(
        total=count * args.multi_turn,
        desc=f"{label} {args.multi_turn} turns",
        unit="req",
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        by_turn = await run_conversations(
            client,
            model,
            args.multi_turn,
            count,
            args.max_tokens,
            on_done=lambda _r, bar=bar: bar.update(1),
            audio_seconds=args.audio_turns,
        )
    failures = [r.error or "error" for entries in by_turn for r, _ in entries if not r.ok]
    if failures:
        errors[f"{label} multi-turn"] = failures
    return summarize_turns(label, by_turn)


async def _bench_level(
    client,
    model: str,
    base_url: str,
    label: str,
    concurrency: int,
    args: argparse.Namespace,
    num_requests: int | None,
    errors: dict[str, list[str]],
    fresh: Callable[[int], Sequence[str]],
) -> list[dict]:
    """One closed-loop level: its warm-up requests, then a row per endpoint (chat, and the
    Realtime API's with --realtime)."""
    from tqdm import tqdm

    from .load import run_level, stream_one
    from .realtime import realtime_one
    from .stats import summarize_level

    rows = []
    n = requests_per_level(num_requests, concurrency)
    for warm_prompt in fresh(args.warmup):
        warm = await stream_one(client, model, warm_prompt, args.max_tokens)
        if not warm.ok:
            print(f"{label} c={concurrency}: the warm-up request failed: {warm.error}", file=sys.stderr)
    for endpoint in ("chat", "realtime") if args.realtime else ("chat",):
        name = label if endpoint == "chat" else f"{label} realtime"
        handoffs_before = await _handoff_totals(base_url)
        with tqdm(
            total=n, desc=f"{name} c={concurrency}", unit="req", file=sys.stderr, dynamic_ncols=True
        ) as bar:
            failed = 0

            def done(record, bar=bar):
                nonlocal failed
                failed += not record.ok
                bar.update(1)
                if failed:
                    bar.set_postfix(errors=failed)

            records, wall_s = await run_level(
                client,
                model,
                concurrency,
                n,
                args.max_tokens,
                prompts=fresh(n),
                on_done=done,
                send=realtime_one if endpoint == "realtime" else stream_one,
            )
        failures = [r.error or "error" for r in records if not r.ok]
        if failures:
            errors[f"{name} c={concurrency}"] = failures
        rows.append(
            {
                "config": name,
                "concurrency": concurrency,
                **summarize_level(records, wall_s, **_slos(args)),
                "kv_handoff_ms_mean": _mean_handoff_ms(handoffs_before, await _handoff_totals(base_url)),
                **({"endpoint": endpoint, "chat_config": label} if args.realtime else {}),
            }
        )
    return rows


async def _bench_open_loop(
    client,
    model: str,
    label: str,
    args: argparse.Namespace,
    rows: list[dict],
    errors: dict[str, list[str]],
    fresh: Callable[[int], Sequence[str]],
) -> list[dict]:
    """--request-rate: one row per rate, a relative rate taken of the capacity the closed-loop
    `rows` measured."""
    from tqdm import tqdm

    from .load import run_open_loop
    from .stats import summarize_level

    open_rows = []
    capacity = max((r["req_per_s"] or 0.0 for r in rows if r.get("endpoint", "chat") == "chat"), default=0.0)
    for offered, value, relative in parse_rates(args.request_rate):
        rate = value * capacity if relative else value
        if rate <= 0:
            print(
                f"{label}: no capacity measured (run closed-loop levels) for rate {offered}",
                file=sys.stderr,
            )
            continue
        n = args.open_loop_requests or (
            QUICK_OPEN_LOOP_REQUESTS if args.quick else DEFAULT_OPEN_LOOP_REQUESTS
        )
        with tqdm(
            total=n, desc=f"{label} rate={rate:.2f}/s", unit="req", file=sys.stderr, dynamic_ncols=True
        ) as bar:
            records, wall_s = await run_open_loop(
                client,
                model,
                rate,
                n,
                args.max_tokens,
                prompts=fresh(n),
                seed=args.seed,
                on_done=lambda _r, bar=bar: bar.update(1),
            )
        failures = [r.error or "error" for r in records if not r.ok]
        if failures:
            errors[f"{label} rate={offered}"] = failures
        open_rows.append(
            {
                "config": label,
                "offered": offered,
                "request_rate": rate,
                "capacity_req_per_s": capacity or None,
                **summarize_level(records, wall_s, **_slos(args)),
            }
        )
    return open_rows


def requests_per_level(num_requests: int | None, concurrency: int) -> int:
    """Measured requests at one level: `num_requests` when given (at least the concurrency),
    else WAVES x the concurrency, at least DEFAULT_NUM_REQUESTS."""
    if num_requests is None:
        return max(DEFAULT_NUM_REQUESTS, WAVES * concurrency)
    return max(num_requests, concurrency)
