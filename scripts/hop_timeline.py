#!/usr/bin/env python
"""Where a request's time goes, hop by hop: one streamed chat request at a time against
`omni-pd serve --trace-hops`, for each stage file, as a table of when it passed the client, the
API server, the orchestrator, each stage worker and the KV transfer (issue 48 item 9).

Each server starts in turn on a free port. After warm-up requests, `--requests` streamed
text-only requests run one after another, each `--prompt-tokens` long (its own number first, so
no prefix is shared) for `--max-tokens` tokens (each config is served with ignore_eos, as
`bench serve --ignore-eos` serves it). The client stamps perf_counter
(CLOCK_MONOTONIC, the clock the server's stamps use, this host only) when it sends, when the
first and last chunks arrive; the server's last chunk carries the rest (`omni_pd_timeline`).
Each hop's cell is its median over the requests, in ms since the client sent; `step` is the
median of the time since the hop before it in the same request.

    .venv/bin/python scripts/hop_timeline.py --json out.json \\
        stage_configs/ci/qwen3_omni_tiny_thinker.yaml stage_configs/ci/qwen3_omni_tiny_thinker_pd.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_pd.bench.serve_configs import resolve_config  # noqa: E402
from omni_pd.bench.sized_prompts import load_tokenizer, sized_prompt  # noqa: E402

NAME = "tiny-qwen3-omni"
TRACE_KEY = "omni_pd_timeline"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(config: str, port: int, log: Path) -> subprocess.Popen:
    command = [
        str(ROOT / ".venv/bin/omni-pd"),
        "serve",
        NAME,
        "--stage-configs-path",
        config,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-demo-page",
        "--trace-hops",
    ]
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
    )


def wait_ready(server: subprocess.Popen, base: str, log: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}); its log: {log}")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # a server starting up: nothing to wait on but its port
    raise SystemExit(f"the server was not ready within {timeout_s:.0f} s; its log: {log}")


def one_request(client: httpx.Client, base: str, prompt: str, max_tokens: int) -> dict:
    """One streamed request: the client's stamps and the server's timeline."""
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text"],
        "max_tokens": max_tokens,
        "stream": True,
    }
    sent = time.perf_counter()
    first = last = None
    timeline = None
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            chunk = json.loads(line[len("data: ") :])
            timeline = chunk.get(TRACE_KEY, timeline)
    if timeline is None:
        raise SystemExit("the server sent no omni_pd_timeline: is it omni-pd serve --trace-hops?")
    assert first is not None and last is not None
    rows = [("client", "sent", 0.0)]
    # The server's times are since it took the request; the client's since it sent: the
    # server's first stamp is put at its own offset from the client's send.
    offset = (timeline["origin"] - sent) * 1e3
    rows += [(r["where"], r["hop"], r["at_ms"] + offset) for r in timeline["hops"]]
    rows += [
        ("client", "first chunk in", (first - sent) * 1e3),
        ("client", "last chunk in", (last - sent) * 1e3),
    ]
    return {"rows": sorted(rows, key=lambda r: r[2])}


def run_config(config: str, args, tokenizer, out: Path) -> list[dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    label, path = resolve_config(config, out, ignore_eos=True)  # every answer max_tokens long
    log = out / f"server.{label}.log"
    server = start_server(str(path), port, log)
    try:
        wait_ready(server, base, log)
        with httpx.Client(timeout=120.0) as client:
            for index in range(args.warmup):
                one_request(
                    client, base, sized_prompt(tokenizer, args.prompt_tokens, 10_000 + index), args.max_tokens
                )
            return [
                one_request(client, base, sized_prompt(tokenizer, args.prompt_tokens, index), args.max_tokens)
                for index in range(args.requests)
            ]
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def summarize(runs: list[dict]) -> list[dict]:
    """Each hop's median time since the client sent and median step from the hop before it."""
    at: dict[tuple[str, str], list[float]] = defaultdict(list)
    step: dict[tuple[str, str], list[float]] = defaultdict(list)
    for run in runs:
        previous = 0.0
        for where, hop, ms in run["rows"]:
            at[(where, hop)].append(ms)
            step[(where, hop)].append(ms - previous)
            previous = ms
    keys = sorted(at, key=lambda k: statistics.median(at[k]))
    return [
        {
            "where": where,
            "hop": hop,
            "at_ms": round(statistics.median(at[(where, hop)]), 3),
            "step_ms": round(statistics.median(step[(where, hop)]), 3),
            "seen": len(at[(where, hop)]),
        }
        for where, hop in keys
    ]


def ttft_agreement(runs: list[dict]) -> dict:
    """Medians of the client's TTFT (sent to first chunk in), the server's (its TTFT metric:
    arrival to first chunk out) and of their difference per request, in ms."""
    client, server, gap = [], [], []
    for run in runs:
        at = {(w, h): ms for w, h, ms in run["rows"]}
        c = at[("client", "first chunk in")] - at[("client", "sent")]
        s = at[("api server", "first chunk out")] - at[("api server", "request in")]
        client.append(c)
        server.append(s)
        gap.append(c - s)
    med = statistics.median
    return {
        "client_ms": round(med(client), 3),
        "server_ms": round(med(server), 3),
        "gap_ms": round(med(gap), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("configs", nargs="+", help="stage files, one server each")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="write every request's rows and the medians here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(NAME)
    out = Path(tempfile.mkdtemp(prefix="hop_timeline."))
    result = {"command": " ".join(sys.argv), "configs": {}}
    for config in args.configs:
        runs = run_config(config, args, tokenizer, out)
        table = summarize(runs)
        agreement = ttft_agreement(runs)
        result["configs"][config] = {"table": table, "ttft": agreement, "runs": runs}
        print(f"\n{config}: medians of {len(runs)} requests, ms since the client sent\n")
        print("| where | hop | at ms | step ms |\n| --- | --- | --- | --- |")
        for row in table:
            print(f"| {row['where']} | {row['hop']} | {row['at_ms']:.2f} | {row['step_ms']:.2f} |")
        print(
            f"\nTTFT medians: client {agreement['client_ms']:.2f} ms, server metric "
            f"{agreement['server_ms']:.2f} ms, client - server {agreement['gap_ms']:.2f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\nservers' logs: {out}")


if __name__ == "__main__":
    main()
