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

`--concurrency N` keeps N requests in flight (closed loop, as `vllm bench serve
--max-concurrency N`), the senders starting `--stagger-ms` apart. Around the measured requests
the script reads the kernel's account of every process on the path
(`/proc/PID/task/*/schedstat`: time on a CPU and time runnable but waiting for one, summed over
threads): the API server with its orchestrator, each stage worker (pids from `/health`) and the
client's sender threads, per request. Time waiting for a CPU is what processes on too few cores
cost each other.

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
import threading
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


def _read_schedstat(path: Path) -> tuple[float, float]:
    fields = path.read_text().split()
    return int(fields[0]) / 1e6, int(fields[1]) / 1e6


def schedstat(pid: int) -> tuple[float, float]:
    """(ms on a CPU, ms runnable but waiting for one), summed over the process's live threads."""
    on_cpu = waiting = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu, wait = _read_schedstat(task / "schedstat")
        except OSError:  # a thread that ended between the listing and the read
            continue
        on_cpu += cpu
        waiting += wait
    return on_cpu, waiting


def path_processes(base: str, server_pid: int) -> dict[str, int]:
    """The processes a request passes: the server (API server and orchestrator) and each stage
    worker."""
    processes: dict[str, int] = {"api server + orchestrator": server_pid}
    for stage_id, stage in httpx.get(f"{base}/health", timeout=10.0).json()["stages"].items():
        for k, replica in enumerate(stage["replicas"]):
            if replica["pid"] is not None:
                suffix = f".r{k}" if len(stage["replicas"]) > 1 else ""
                processes[f"stage {stage_id}{suffix} ({stage['name']})"] = replica["pid"]
    return processes


def run_requests(client: httpx.Client, base: str, prompts: list[str], args) -> tuple[list[dict], list[float]]:
    """Every prompt once, `args.concurrency` at a time, each sender taking the next prompt when
    its answer is done (closed loop); results in prompt order, and the client's own (ms on a
    CPU, ms waiting for one), each sender thread reading its own account before it ends."""
    results: list[dict | None] = [None] * len(prompts)
    taken = iter(range(len(prompts)))
    lock = threading.Lock()
    errors: list[BaseException] = []
    client_account = [0.0, 0.0]
    own = Path("/proc/thread-self/schedstat")

    def sender(offset_s: float) -> None:
        time.sleep(offset_s)  # an arrival offset, so the senders do not start in step
        start = _read_schedstat(own)
        try:
            while True:
                with lock:
                    index = next(taken, None)
                if index is None:
                    return
                results[index] = one_request(client, base, prompts[index], args.max_tokens)
        except BaseException as exc:  # reported after the join, not lost in a thread
            errors.append(exc)
        finally:
            end = _read_schedstat(own)
            with lock:
                client_account[0] += end[0] - start[0]
                client_account[1] += end[1] - start[1]

    threads = [
        threading.Thread(target=sender, args=(k * args.stagger_ms / 1e3,)) for k in range(args.concurrency)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], client_account


def run_config(config: str, args, tokenizer, out: Path) -> tuple[list[dict], dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    label, path = resolve_config(config, out, ignore_eos=True)  # every answer max_tokens long
    log = out / f"server.{label}.log"
    server = start_server(str(path), port, log)
    try:
        wait_ready(server, base, log)
        with httpx.Client(timeout=120.0, limits=httpx.Limits(max_connections=args.concurrency + 2)) as client:
            warm = [sized_prompt(tokenizer, args.prompt_tokens, 10_000 + i) for i in range(args.warmup)]
            run_requests(client, base, warm, args)
            processes = path_processes(base, server.pid)
            prompts = [sized_prompt(tokenizer, args.prompt_tokens, i) for i in range(args.requests)]
            before = {name: schedstat(pid) for name, pid in processes.items()}
            started = time.perf_counter()
            runs, client_account = run_requests(client, base, prompts, args)
            wall_ms = (time.perf_counter() - started) * 1e3
            after = {name: schedstat(pid) for name, pid in processes.items()}
        before["client"], after["client"] = (0.0, 0.0), (client_account[0], client_account[1])
        cpu = {
            name: {
                "cpu_ms_per_request": round((after[name][0] - before[name][0]) / len(runs), 3),
                "wait_ms_per_request": round((after[name][1] - before[name][1]) / len(runs), 3),
                "busy": round((after[name][0] - before[name][0]) / wall_ms, 3),
            }
            for name in after
        }
        return runs, {"wall_ms": round(wall_ms, 1), "processes": cpu}
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
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop)")
    parser.add_argument(
        "--stagger-ms",
        type=float,
        default=25.0,
        help="sender k starts k times this late: senders that start together stay in step (their "
        "answers end in one engine step and their next prompts arrive together)",
    )
    parser.add_argument("--json", help="write every request's rows and the medians here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(NAME)
    out = Path(tempfile.mkdtemp(prefix="hop_timeline."))
    result = {"command": " ".join(sys.argv), "configs": {}}
    for config in args.configs:
        runs, cpu = run_config(config, args, tokenizer, out)
        table = summarize(runs)
        agreement = ttft_agreement(runs)
        result["configs"][config] = {"table": table, "ttft": agreement, "cpu": cpu, "runs": runs}
        print(
            f"\n{config}: medians of {len(runs)} requests at concurrency {args.concurrency}, "
            "ms since the client sent\n"
        )
        print("| where | hop | at ms | step ms |\n| --- | --- | --- | --- |")
        for row in table:
            print(f"| {row['where']} | {row['hop']} | {row['at_ms']:.2f} | {row['step_ms']:.2f} |")
        print(
            f"\nTTFT medians: client {agreement['client_ms']:.2f} ms, server metric "
            f"{agreement['server_ms']:.2f} ms, client - server {agreement['gap_ms']:.2f} ms"
        )
        print(f"\neach process's CPU per request, over {cpu['wall_ms'] / 1e3:.1f} s of requests\n")
        print("| process | CPU ms | waiting for a CPU ms | busy |\n| --- | --- | --- | --- |")
        for name, row in cpu["processes"].items():
            print(
                f"| {name} | {row['cpu_ms_per_request']:.2f} | {row['wait_ms_per_request']:.2f} | "
                f"{row['busy']:.2f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\nservers' logs: {out}")


if __name__ == "__main__":
    main()
