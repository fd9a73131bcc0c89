"""`omni-pd bench serve`: load-test the OpenAI-compatible server, several stage configs side by side.

For each config it starts `omni-pd serve` on a free loopback port (or uses `--base-url`), and for
each concurrency level sends one uncounted warm-up request, then `--num-requests` streaming
text+audio chat completions with exactly `concurrency` in flight. It prints a table, and writes a
JSON file (`--json`) and a PNG (`--plot`).

By default a level measures `WAVES` times its concurrency in requests (at least 16): with only as
many requests as clients, a level is one burst that starts together and drains together, and its
req/s measures the ramp as much as the load (run to run it moved by 15% at concurrency 16).

Open loop (`--request-rate`, vLLM's flag): after the closed-loop levels, requests arrive as a
Poisson process of the given rate whatever is in flight, so latency shows what a server past its
capacity does; a rate written `N%` is that share of the config's capacity as measured by its
closed-loop levels in the same run (its best req/s). With `--slo-ttft-ms` / `--slo-ttfa-ms` each
level reports goodput: requests per second within the SLOs (`--slo-itl-ms`: each request's mean
time per output token, DistServe's TPOT, within it too).

Mixed lengths (`--prompt-tokens` / `--output-tokens`, each `N` or `uniform:LO:HI`): request i of
every level and rate gets the i-th (prompt length, output length) of one sequence drawn from
`--seed`, the same in every config; `--ignore-eos` makes each answer exactly its drawn length.
The JSON holds the spec and the drawn lengths' mean / min / max (`workload`), and each row its
requests' drawn and answered token counts (`requests`). workload.py draws them.

`--text-only` measures the thinker alone: requests ask for `modalities: ["text"]` (no TTFA), on
the thinker-only configs by default (`qwen3_omni_tiny_thinker.yaml`, `..._thinker_pd.yaml`,
which load no talker and no code2wav). A text-only request to a whole omni config runs its
thinker stages only, but that server still holds the talker and code2wav.

`--multi-turn K` runs conversations of K turns instead of the levels (each turn sends the whole
history after a long system prompt) and reports TTFT and TTFA per turn; by default on the two
default configs with prefix caching on and off (`PATH@prefix_caching=false`), side by side.

`--xpyd 1P1D,1P2D,2P2D` benchmarks, in one run, each P/D layout against the fair baseline: the
colocated pipeline with as many thinker replicas as the layout has thinker workers (x + y),
behind the same router, on the same cores. `colocated-Nx` adds a colocated layout of its own:
`--xpyd 1P1D,colocated-1x` measures 1P1D, colocated-2x and one thinker on all the cores. Each
layout gets the same CPUs, `--xpyd-cpus` (default: all this process may run on), shared evenly
among its thinker workers as `runtime.cpus` (prefill replicas first, then decode; torch runs one
thread per CPU), so on CPUs 0-1 1P1D is prefill 0 and decode 1, colocated-2x a replica on each,
colocated-1x one replica on 0-1 with two threads; the talker and code2wav stay unpinned. CPUs
that the workers do not divide evenly are refused; the JSON's `target_cpus` says who got what.
`--xpyd-cpus none` pins nothing (stages Ray places on other nodes, or on GPUs).

    omni-pd bench serve [--configs A.yaml,B.yaml | --xpyd 1P1D,2P2D [--xpyd-cpus 0-3]]
                        [--concurrency 1,4,8,16]
                        [--request-rate 50%,90%] [--slo-ttft-ms MS] [--slo-ttfa-ms MS]
                        [--prompt-tokens N|uniform:LO:HI] [--output-tokens N|uniform:LO:HI]
                        [--text-only] [--num-requests N] [--json out.json] [--plot out.png] [--quick]

This module holds the flags and the run over the servers; serve_configs.py resolves the configs
each server runs, workload.py draws the requests' lengths, serve_target.py measures one server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import STAGE_CONFIGS_DIR
from .capacity import check_kv_capacity
from .serve_configs import parse_server_env, resolve_config, unique_labels, xpyd_targets
from .xpyd_layouts import bench_cpus
from .serve_target import (
    DEFAULT_NUM_REQUESTS,
    DEFAULT_OPEN_LOOP_REQUESTS,
    QUICK_NUM_REQUESTS,
    QUICK_OPEN_LOOP_REQUESTS,
    WAVES,
    bench_target,
    parse_rates,
    requests_per_level,
)
from .workload import DEFAULT_MAX_TOKENS, MIN_PROMPT_TOKENS, workload_from_args

DEFAULT_CONFIGS = (
    STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml",
    STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml",
)
# --text-only: the thinker served alone, colocated and P/D (no talker, no code2wav loaded).
TEXT_ONLY_CONFIGS = (
    STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_thinker.yaml",
    STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_thinker_pd.yaml",
)
DEFAULT_MODEL = "tiny-qwen3-omni"
DEFAULT_CONCURRENCY, QUICK_CONCURRENCY = "1,4,8,16", "1,4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated stage YAMLs, benchmarked one after the other and "
        "reported side by side, each labelled by its file stem; "
        "PATH@key=value sets a top-level key on a copy (e.g. "
        "PATH@async_chunk=false); prefix_caching=BOOL sets it on every thinker stage, "
        "transfer_mode=push|pull, kv_same_host=... and kv_push_chunk_tokens=N in every "
        "stage's kv_connector_extra_config, load_format=FORMAT "
        "on every stage (auto: read --model's weights) (default: "
        "stage_configs/ci/qwen3_omni_tiny.yaml,"
        "stage_configs/ci/qwen3_omni_tiny_pd.yaml; --text-only: "
        "stage_configs/ci/qwen3_omni_tiny_thinker.yaml,"
        "stage_configs/ci/qwen3_omni_tiny_thinker_pd.yaml)",
    )
    parser.add_argument(
        "--base-url",
        default=None,
        help="benchmark this running server (e.g. http://127.0.0.1:8000) instead of starting one per config",
    )
    parser.add_argument(
        "--label", default=None, help="the name of the --base-url server in the report (default: host:port)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"model to serve and to request (default: {DEFAULT_MODEL}; with "
        "--base-url: the first of the server's GET /v1/models)",
    )
    parser.add_argument(
        "--concurrency",
        default=None,
        help=f"comma-separated requests in flight per level (default: "
        f"{DEFAULT_CONCURRENCY}; --quick: {QUICK_CONCURRENCY})",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"measured requests per level, at least the concurrency (default: "
        f"{WAVES} x the concurrency, at least {DEFAULT_NUM_REQUESTS}; --quick: "
        f"{QUICK_NUM_REQUESTS})",
    )
    parser.add_argument(
        "--request-rate",
        default=None,
        help="comma-separated open-loop rates (requests/s, Poisson arrivals), run "
        "after the closed-loop levels; N%% is that share of the config's "
        "capacity measured in this run (e.g. 50%%,90%%)",
    )
    parser.add_argument(
        "--open-loop-requests",
        type=int,
        default=None,
        help=f"requests per open-loop rate (default {DEFAULT_OPEN_LOOP_REQUESTS}; "
        f"--quick: {QUICK_OPEN_LOOP_REQUESTS})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the Poisson arrivals and of the drawn --prompt-tokens / --output-tokens lengths",
    )
    parser.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="TTFT service-level objective: goodput counts requests within it",
    )
    parser.add_argument(
        "--slo-ttfa-ms",
        type=float,
        default=None,
        help="time-to-first-audio objective (a request without speech has none)",
    )
    parser.add_argument(
        "--slo-itl-ms",
        type=float,
        default=None,
        help="inter-token objective, judged per request on its mean time per output token "
        "after the first (DistServe's TPOT): goodput counts a request only if every SLO holds",
    )
    parser.add_argument(
        "--xpyd",
        default=None,
        help="comma-separated P/D layouts (e.g. 1P1D,1P2D,2P2D), each run beside "
        "colocated with x+y thinker replicas (colocated-2x for 1P1D), and colocated-Nx layouts of "
        "their own (colocated-1x: one thinker on all of --xpyd-cpus); excludes --configs",
    )
    parser.add_argument(
        "--xpyd-cpus",
        default=None,
        metavar="LIST",
        help="the CPUs every --xpyd layout gets (cpulist, e.g. 0-3; default: every CPU this "
        "process may run on), shared evenly among its thinker workers, prefill replicas first, "
        "as their runtime.cpus (one torch thread per CPU); talker and code2wav unpinned; "
        "none: pin nothing (Ray-placed or GPU stages)",
    )
    parser.add_argument(
        "--xpyd-pd-config",
        default=None,
        help="the P/D stage YAML the layouts are made from (default: "
        f"{DEFAULT_CONFIGS[1].name}; --text-only: {TEXT_ONLY_CONFIGS[1].name})",
    )
    parser.add_argument(
        "--xpyd-colocated-config",
        default=None,
        help="the colocated stage YAML the baselines are made from (default: "
        f"{DEFAULT_CONFIGS[0].name}; --text-only: {TEXT_ONLY_CONFIGS[0].name})",
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run each closed-loop level through the Realtime API (/v1/realtime) "
        "too, with the same prompts, and report its TTFA against the chat "
        "endpoint's (ttfa_vs_chat)",
    )
    parser.add_argument(
        "--multi-turn",
        type=int,
        default=None,
        metavar="K",
        help="run conversations of K turns (the whole history each turn, after a "
        "long system prompt) instead of the concurrency levels; default "
        "configs: the two defaults with prefix caching on and off",
    )
    parser.add_argument(
        "--audio-turns",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --multi-turn: each user turn also carries a synthetic clip this "
        "many seconds long (an input_audio part), resent with the history",
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="conversations per config with --multi-turn, one after another (default 4; --quick: 2)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"max_tokens of every request (default {DEFAULT_MAX_TOKENS}; excludes --output-tokens)",
    )
    parser.add_argument(
        "--output-tokens",
        default=None,
        metavar="N|uniform:LO:HI",
        help="each request's max_tokens: N, or drawn per request uniformly from LO..HI "
        "(inclusive) by --seed, the same sequence for every config and level; only "
        "--ignore-eos makes each answer exactly that long",
    )
    parser.add_argument(
        "--prompt-tokens",
        default=None,
        metavar="N|uniform:LO:HI",
        help=f"make each user message N tokens of the served model's tokenizer, or a length "
        f"drawn per request uniformly from LO..HI (inclusive) by --seed (at least "
        f"{MIN_PROMPT_TOKENS}); each begins with its own number so that no two share a prefix "
        "(default: short varied prompts)",
    )
    parser.add_argument(
        "--text-only",
        action="store_true",
        help='measure the thinker alone: requests ask for text only (modalities ["text"]), so '
        "no TTFA (--slo-ttfa-ms, --realtime and --multi-turn are refused); default configs, "
        "and --xpyd's: the thinker-only qwen3_omni_tiny_thinker.yaml and "
        "qwen3_omni_tiny_thinker_pd.yaml",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="set ignore_eos in every stage's default_sampling_params of the served "
        "configs (vLLM's benchmark flag): every request then runs each stage to "
        "its max_tokens, so its work does not depend on when random weights "
        "happen to sample an EOS (the talker never samples its codec EOS); this is "
        "what makes --output-tokens lengths exact",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="uncounted requests sent before each level (default 1)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--plot", default=None, metavar="PATH", help="write a PNG: req/s and latency against concurrency"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"CI mode: concurrency {QUICK_CONCURRENCY}, {QUICK_NUM_REQUESTS} "
        "requests per level (explicit options still win)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take, for the client and the started "
        "servers' --request-timeout (default 600)",
    )
    parser.add_argument(
        "--no-keep-alive",
        action="store_true",
        help="open a new connection for each chat request, as vllm-omni's benchmark client does "
        "(default: connections kept open between requests, as vLLM's client and the openai SDK keep them)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds a started server has to answer GET /health with 200",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="environment variable for the started servers (repeatable), e.g. "
        "OMP_NUM_THREADS=1; the rest is inherited, MC_LOG_LEVEL=ERROR unless set",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an `omni-pd serve` option for the started servers (repeatable; "
        "--serve-arg=--max-queued-requests=8)",
    )
    parser.add_argument(
        "--server-log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="--log-level of the started servers (their log goes to a temp file)",
    )


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"error: {what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"error: {what} must be positive integers, got {text!r}")
    return sorted(dict.fromkeys(values))


def add_baseline_ratios(rows: list[dict], baselines: dict[str, str], level_key: str) -> None:
    """For each row of a config with a baseline (`--xpyd`: the colocated replicas), its req/s and
    goodput against the baseline's at the same level, measured in the same run."""
    from .stats import ratio

    by_level = {(r["config"], r[level_key]): r for r in rows}
    for row in rows:
        base = by_level.get((baselines.get(row["config"]), row[level_key]))
        if base is not None:
            row["baseline"] = base["config"]
            row["req_per_s_vs_baseline"] = ratio(row["req_per_s"], base["req_per_s"])
            if "goodput_req_per_s" in row:
                row["goodput_vs_baseline"] = ratio(row["goodput_req_per_s"], base.get("goodput_req_per_s"))


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="omni-pd-bench-") as scratch:  # overridden configs
        return _run(args, Path(scratch))


def _run(args: argparse.Namespace, scratch: Path) -> int:
    levels, num_requests, server_env = _checked_args(args)
    targets, baselines, target_cpus = _targets(args, scratch)
    check_kv_capacity(targets, workload_from_args(args))
    runs = _Runs(model_used=args.model)
    for label, config in targets:
        if config is None:
            _bench_base_url(runs, label, args, levels, num_requests)
        else:
            _bench_started_server(runs, label, config, args, levels, num_requests, server_env)
    _add_comparisons(runs, baselines, args)
    _print_tables(runs)
    meta = _metadata(args, runs, levels, num_requests, targets, server_env, baselines)
    meta["target_cpus"] = target_cpus
    _write_outputs(args, meta, runs)
    return 1 if runs.failures or not (runs.results or runs.multi_turn) else 0


def _checked_args(args: argparse.Namespace) -> tuple[list[int], int | None, dict[str, str]]:
    """The concurrency levels, the requests per level (None: by concurrency) and the servers'
    environment; any argument that cannot work refused before a server starts."""
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("error: omni-pd bench needs the openai client: pip install openai") from None
    # The client libraries log every request at INFO, which would break up the progress bar.
    for name in ("httpx", "httpx2", "httpcore", "openai", "matplotlib"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    if sum(map(bool, (args.base_url, args.configs, args.xpyd))) > 1:
        raise SystemExit("error: --configs, --xpyd and --base-url exclude each other")
    if args.xpyd_cpus is not None and not args.xpyd:
        raise SystemExit("error: --xpyd-cpus shares CPUs among the --xpyd layouts; add --xpyd")
    if args.base_url and args.ignore_eos:
        raise SystemExit(
            "error: --ignore-eos changes the configs bench starts servers with; for "
            "--base-url, set ignore_eos in that server's stage YAML instead"
        )
    levels = _int_list(
        args.concurrency or (QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY), "--concurrency"
    )
    num_requests = (
        args.num_requests if args.num_requests is not None else QUICK_NUM_REQUESTS if args.quick else None
    )  # None: by concurrency
    if (num_requests is not None and num_requests < 1) or args.warmup < 0:
        raise SystemExit("error: --num-requests must be >= 1, --warmup >= 0")
    workload_from_args(args)  # refuse a bad length or a clash of length flags now
    _check_text_only(args)
    for flag, value in (
        ("--slo-ttft-ms", args.slo_ttft_ms),
        ("--slo-ttfa-ms", args.slo_ttfa_ms),
        ("--slo-itl-ms", args.slo_itl_ms),
    ):
        if value is not None and not value > 0:  # NaN too
            raise SystemExit(f"error: {flag} must be a number of milliseconds above 0, got {value}")
    if args.audio_turns is not None and not (args.multi_turn and 0 < args.audio_turns <= 30):
        raise SystemExit(
            "error: --audio-turns needs --multi-turn and a clip length in seconds above 0 and at most 30"
        )
    server_env = parse_server_env(args.server_env)
    parse_rates(args.request_rate)  # refuse a bad rate before any server starts
    return levels, num_requests, server_env


def _check_text_only(args: argparse.Namespace) -> None:
    """--text-only asks for no audio: refuse what would measure or judge it."""
    if not args.text_only:
        return
    for flag, given in (
        ("--slo-ttfa-ms", args.slo_ttfa_ms is not None),
        ("--realtime", args.realtime),
    ):
        if given:
            raise SystemExit(
                f"error: --text-only requests have no audio, so {flag} has nothing to measure; "
                f"drop {flag} or --text-only"
            )


def _targets(
    args: argparse.Namespace, scratch: Path
) -> tuple[list[tuple[str, Path | None]], dict[str, str], dict[str, dict[str, list[str]]]]:
    """(label, config) of each server to measure (config None: the --base-url server), each
    --xpyd layout's baseline label, and each --xpyd layout's thinker CPUs by role."""
    baselines: dict[str, str] = {}
    target_cpus: dict[str, dict[str, list[str]]] = {}
    if args.base_url:
        from urllib.parse import urlparse

        targets: list[tuple[str, Path | None]] = [
            (args.label or urlparse(args.base_url).netloc or args.base_url, None)
        ]
    elif args.xpyd:
        cpus = bench_cpus(args.xpyd_cpus)
        colocated, pd = TEXT_ONLY_CONFIGS if args.text_only else DEFAULT_CONFIGS
        made = xpyd_targets(
            args.xpyd,
            args.xpyd_pd_config or str(pd),
            args.xpyd_colocated_config or str(colocated),
            scratch,
            cpus,
        )
        targets = [(t.label, resolve_config(str(t.config), scratch, args.ignore_eos)[1]) for t in made]
        baselines = {t.label: t.baseline for t in made if t.baseline}
        target_cpus.update({t.label: t.cpus for t in made})
    else:
        defaults = [str(p) for p in (TEXT_ONLY_CONFIGS if args.text_only else DEFAULT_CONFIGS)]
        if args.multi_turn:  # each default with the prefix cache on, then off
            defaults = [v for p in defaults for v in (p, f"{p}@prefix_caching=false")]
        resolved = [
            resolve_config(p, scratch, args.ignore_eos)
            for p in (args.configs.split(",") if args.configs else defaults)
            if p.strip()
        ]
        targets = list(zip(unique_labels([label for label, _ in resolved]), [p for _, p in resolved]))
    return targets, baselines, target_cpus


@dataclass
class _Runs:
    """What the servers measured so far: the rows of each kind, the errors by level, the
    targets that could not be measured, and the model name used."""

    model_used: str | None
    results: list[dict] = field(default_factory=list)
    open_loop: list[dict] = field(default_factory=list)
    multi_turn: list[dict] = field(default_factory=list)
    errors: dict[str, list[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, rows: list[dict], open_rows: list[dict], turn_rows: list[dict]) -> None:
        self.results += rows
        self.open_loop += open_rows
        self.multi_turn += turn_rows


def _bench_base_url(
    runs: _Runs, label: str, args: argparse.Namespace, levels: list[int], num_requests: int | None
) -> None:
    from .server import health_status

    status = health_status(args.base_url.rstrip("/"), timeout_s=10)
    if status != 200:
        print(
            f"error: GET {args.base_url.rstrip('/')}/health answered {status or 'nothing'}, not 200",
            file=sys.stderr,
        )
        runs.failures.append(f"{label}: the server is not ready")
        return
    runs.model_used, rows, open_rows, turn_rows = asyncio.run(
        bench_target(args.base_url, label, args.model, levels, args, num_requests, runs.errors)
    )
    runs.add(rows, open_rows, turn_rows)


def _bench_started_server(
    runs: _Runs,
    label: str,
    config: Path,
    args: argparse.Namespace,
    levels: list[int],
    num_requests: int | None,
    server_env: dict[str, str],
) -> None:
    """Start `omni-pd serve` with `config`, measure it, stop it."""
    from .server import ServerProcess, ServerStartError

    runs.model_used = args.model or DEFAULT_MODEL
    server = ServerProcess(
        runs.model_used,
        config,
        request_timeout_s=args.request_timeout,
        startup_timeout_s=args.startup_timeout,
        env=server_env,
        log_level=args.server_log_level,
        serve_args=args.serve_arg,
    )
    print(f"{label}: starting omni-pd serve ({config})", file=sys.stderr)
    try:
        server.start()
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        runs.failures.append(f"{label}: the server did not start")
        return
    try:
        _, rows, open_rows, turn_rows = asyncio.run(
            bench_target(server.base_url, label, runs.model_used, levels, args, num_requests, runs.errors)
        )
        runs.add(rows, open_rows, turn_rows)
    finally:
        status = server.stop()
    if status not in (0, -signal.SIGTERM):
        print(f"warning: {label}: the server exited with {status}; log {server.log_path}", file=sys.stderr)


def _add_comparisons(runs: _Runs, baselines: dict[str, str], args: argparse.Namespace) -> None:
    """Each row's ratios: to the first config, to chat (--realtime), to its baseline (--xpyd),
    to the same config without the prefix cache (--multi-turn)."""
    from .stats import add_ratios

    add_ratios(runs.results)
    if args.realtime:
        from .realtime import add_vs_chat

        add_vs_chat(runs.results)
    add_baseline_ratios(runs.results, baselines, "concurrency")
    add_baseline_ratios(runs.open_loop, baselines, "offered")
    if runs.multi_turn:
        from .multi_turn import add_uncached_ratios, uncached_twins

        add_uncached_ratios(runs.multi_turn, uncached_twins({row["config"] for row in runs.multi_turn}))


def _print_tables(runs: _Runs) -> None:
    from .report import format_multi_turn_table, format_open_loop_table, format_table, print_errors

    if runs.errors:
        print_errors(runs.errors)
    if runs.results:
        print(format_table(runs.results))
    if runs.open_loop:
        print()
        print(format_open_loop_table(runs.open_loop))
    if runs.multi_turn:
        print()
        print(format_multi_turn_table(runs.multi_turn))


def _metadata(
    args: argparse.Namespace,
    runs: _Runs,
    levels: list[int],
    num_requests: int | None,
    targets: list[tuple[str, Path | None]],
    server_env: dict[str, str],
    baselines: dict[str, str],
) -> dict:
    from .report import run_metadata

    workload = workload_from_args(args)
    fixed = workload.output.lo == workload.output.hi
    return run_metadata(
        ["omni-pd", *sys.argv[1:]],
        argv=list(sys.argv),
        max_tokens=workload.output.lo if fixed else None,  # else each request's: `workload`
        workload=None if args.multi_turn else workload.describe(_requests_drawn(args, levels, num_requests)),
        text_only=bool(args.text_only),
        num_requests=[requests_per_level(num_requests, c) for c in levels],
        concurrency=levels,
        warmup_requests=args.warmup,
        quick=bool(args.quick),
        model=runs.model_used,
        base_url=args.base_url,
        configs={label: (str(path) if path else None) for label, path in targets},
        request_timeout_s=args.request_timeout,
        server_env=server_env,
        failures=runs.failures,
        request_rate=args.request_rate,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_ttfa_ms=args.slo_ttfa_ms,
        slo_itl_ms=args.slo_itl_ms,
        seed=args.seed,
        xpyd=args.xpyd,
        baselines=baselines,
        serve_args=args.serve_arg,
        multi_turn=args.multi_turn,
        conversations=args.conversations,
        audio_turns_s=args.audio_turns,
        realtime=args.realtime,
    )


def _requests_drawn(args: argparse.Namespace, levels: list[int], num_requests: int | None) -> int:
    """The most requests one batch sends (a level, a rate, the warm-up): each sends a prefix of
    the same drawn lengths."""
    from .serve_target import open_loop_requests

    sizes = [requests_per_level(num_requests, c) for c in levels] + [args.warmup]
    if args.request_rate:
        sizes.append(open_loop_requests(args))
    return max(sizes)


def _write_outputs(args: argparse.Namespace, meta: dict, runs: _Runs) -> None:
    from .report import cpu_count, write_json, write_plot

    if args.json:
        write_json(args.json, meta, runs.results, runs.open_loop, runs.multi_turn)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and runs.results:
        write_plot(
            args.plot, runs.results, cores=cpu_count(), max_tokens=str(workload_from_args(args).output)
        )
        print(f"wrote {args.plot}", file=sys.stderr)
