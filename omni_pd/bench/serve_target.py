"""One server measured by `omni-pd bench serve`: its closed-loop concurrency levels (and their
Realtime API twins), its open-loop request rates, or its multi-turn conversations; the prompts
they send and the KV handoff time the server reports."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from .stats import RequestRecord
from .workload import Workload, workload_from_args

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


@dataclass(frozen=True)
class Batch:
    """The next requests to send: their prompts, their max_tokens and their drawn prompt lengths
    (None: a short varied prompt)."""

    prompts: list[str]
    max_tokens: list[int]
    prompt_tokens: list[int | None]


class Requests:
    """The requests a server is sent, batch by batch. Request i of a batch has the workload's
    i-th lengths; prompts are numbered on from the last batch (a sized one never repeats; the
    short varied ones of load.PROMPTS do)."""

    def __init__(self, workload: Workload, tokenizer_model: str) -> None:
        self.workload, self._made, self._tokenizer = workload, 0, None
        if workload.prompt is not None:
            from .sized_prompts import load_tokenizer

            self._tokenizer = load_tokenizer(tokenizer_model)

    def next(self, n: int) -> Batch:
        from .load import PROMPTS
        from .sized_prompts import sized_prompt

        pairs = self.workload.pairs(n)
        prompts = [
            PROMPTS[i % len(PROMPTS)]
            if length is None
            else sized_prompt(self._tokenizer, length, self._made + i)
            for i, (length, _) in enumerate(pairs)
        ]
        self._made += n
        return Batch(prompts, [out for _, out in pairs], [length for length, _ in pairs])


def _request_rows(records: Sequence[RequestRecord], batch: Batch) -> list[dict]:
    """Each request's drawn lengths beside the token counts its answer reported (`usage`; the
    prompt's count includes the chat template's tokens), and its TTFT, mean TPOT and end-to-end
    time (ms), so that goodput under any SLO can be computed again from the JSON."""
    from .stats import mean_tpot_s

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1e3

    return [
        {
            "index": i,
            "ok": record.ok,
            "prompt_tokens_drawn": batch.prompt_tokens[i],
            "output_tokens_drawn": batch.max_tokens[i],
            "prompt_tokens": record.prompt_tokens,
            "output_tokens": record.output_tokens if record.ok else None,
            "ttft_ms": ms(record.ttft_s) if record.ok else None,
            "tpot_ms": ms(mean_tpot_s(record)) if record.ok else None,
            "e2e_ms": ms(record.e2e_s) if record.ok else None,
        }
        for i, record in enumerate(records)
    ]


def _sender(args: argparse.Namespace) -> Callable[..., Awaitable[RequestRecord]]:
    """The chat request of every level: text and speech, or text alone (--text-only)."""
    from .load import stream_one

    return functools.partial(stream_one, text_only=True) if args.text_only else stream_one


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

    from .chat_sse import BenchClient, ChatStreamer

    # The servers it starts inherit OMNI_PD_API_KEY (and a --base-url server may need it too).
    api_key = os.environ.get("OMNI_PD_API_KEY") or "unused"
    client = BenchClient(
        sdk=openai.AsyncOpenAI(
            base_url=f"{base_url.rstrip('/')}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=args.request_timeout,
        ),
        chat=ChatStreamer(base_url, api_key, args.request_timeout, keep_alive=not args.no_keep_alive),
    )
    rows, open_rows, turn_rows = [], [], []
    try:
        if model is None:
            listed = await client.sdk.models.list()
            model = listed.data[0].id
        workload = workload_from_args(args)
        fresh = Requests(workload, args.model or model)
        if args.multi_turn:
            turn_rows = await _bench_multi_turn(client, model, label, args, errors, workload.output.lo)
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
    client, model: str, label: str, args: argparse.Namespace, errors: dict[str, list[str]], max_tokens: int
) -> list[dict]:
    """--multi-turn: the warm-up requests, then the conversations; one row per turn."""
    from tqdm import tqdm

    from .load import PROMPTS
    from .multi_turn import run_conversations, summarize_turns

    send = _sender(args)  # --text-only: the turns ask for text alone (TTFT, no TTFA)
    for i in range(args.warmup):
        await send(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)
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
            max_tokens,
            on_done=lambda _r, bar=bar: bar.update(1),
            audio_seconds=args.audio_turns,
            send=send,
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
    fresh: Requests,
) -> list[dict]:
    """One closed-loop level: its warm-up requests, then a row per endpoint (chat, and the
    Realtime API's with --realtime)."""
    from tqdm import tqdm

    from .load import run_level
    from .realtime import realtime_one
    from .stats import summarize_level

    rows = []
    n = requests_per_level(num_requests, concurrency)
    warm_up = fresh.next(args.warmup)
    for warm_prompt, warm_tokens in zip(warm_up.prompts, warm_up.max_tokens):
        warm = await _sender(args)(client, model, warm_prompt, warm_tokens)
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

            batch = fresh.next(n)
            records, wall_s = await run_level(
                client,
                model,
                concurrency,
                n,
                batch.max_tokens,
                prompts=batch.prompts,
                on_done=done,
                send=realtime_one if endpoint == "realtime" else _sender(args),
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
                **({"requests": _request_rows(records, batch)} if fresh.workload.listed else {}),
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
    fresh: Requests,
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
        n = open_loop_requests(args)
        batch = fresh.next(n)
        with tqdm(
            total=n, desc=f"{label} rate={rate:.2f}/s", unit="req", file=sys.stderr, dynamic_ncols=True
        ) as bar:
            records, wall_s = await run_open_loop(
                client,
                model,
                rate,
                n,
                batch.max_tokens,
                prompts=batch.prompts,
                seed=args.seed,
                on_done=lambda _r, bar=bar: bar.update(1),
                send=_sender(args),
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
                **({"requests": _request_rows(records, batch)} if fresh.workload.listed else {}),
            }
        )
    return open_rows


def open_loop_requests(args: argparse.Namespace) -> int:
    """Requests per open-loop rate: --open-loop-requests, else the default (--quick: fewer)."""
    return args.open_loop_requests or (QUICK_OPEN_LOOP_REQUESTS if args.quick else DEFAULT_OPEN_LOOP_REQUESTS)


def requests_per_level(num_requests: int | None, concurrency: int) -> int:
    """Measured requests at one level: `num_requests` when given (at least the concurrency),
    else WAVES x the concurrency, at least DEFAULT_NUM_REQUESTS."""
    if num_requests is None:
        return max(DEFAULT_NUM_REQUESTS, WAVES * concurrency)
    return max(num_requests, concurrency)
