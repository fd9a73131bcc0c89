"""What a benchmark run writes: the table on stdout, the JSON file, the PNG plot."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import sys
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Sequence

from .stats import vs_config_key


def _version(package: str) -> str | None:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_metadata(command: Sequence[str], **settings: Any) -> dict:
    """The command line, the date and the machine, plus the run's `settings`."""
    return {
        "command": shlex.join(command),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": cpu_count(),
            "cpu_count_total": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "openai": _version("openai"),
        },
        **settings,
    }


def _clean(value: Any) -> Any:
    """NaN and infinities become None, recursively, so the JSON holds null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(
    path: str | Path,
    meta: dict,
    results: list[dict],
    open_loop: list[dict] | None = None,
    multi_turn: list[dict] | None = None,
) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        **meta,
        "results": results,
        **({"open_loop": open_loop} if open_loop else {}),
        **({"multi_turn": multi_turn} if multi_turn else {}),
    }
    with open(path, "w") as handle:
        json.dump(_clean(body), handle, indent=2, allow_nan=False)
        handle.write("\n")


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _grid(rows: list[dict], columns: list[tuple[str, str, int]]) -> str:
    cells = [[title for title, _, _ in columns]]
    for row in rows:
        cells.append([_fmt(row.get(key), digits) for _, key, digits in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = []
    for n, line in enumerate(cells):
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _extra_columns(rows: list[dict]) -> list[tuple[str, str, int]]:
    """Goodput, no-speech answers and baseline ratios, where a row has them."""
    columns = []
    for title, key, digits in (
        ("no speech", "no_speech", 0),
        ("429", "rejected", 0),
        ("goodput", "goodput_req_per_s", 2),
        ("in SLO", "slo_attainment", 2),
        ("req/s vs baseline", "req_per_s_vs_baseline", 2),
        ("goodput vs baseline", "goodput_vs_baseline", 2),
        ("ttft vs chat", "ttft_vs_chat", 2),
        ("ttfa vs chat", "ttfa_vs_chat", 2),
    ):
        if any(row.get(key) for row in rows):
            columns.append((title, key, digits))
    return columns


def format_open_loop_table(rows: list[dict]) -> str:
    """One row per (config, offered rate): Poisson arrivals, latency percentiles, goodput."""
    columns: list[tuple[str, str, int]] = [
        ("config", "config", 0),
        ("offered", "offered", 0),
        ("rate/s", "request_rate", 2),
        ("n", "num_requests", 0),
        ("err", "errors", 0),
        ("req/s", "req_per_s", 2),
        ("ttft p50", "ttft_ms_p50", 1),
        ("ttft p99", "ttft_ms_p99", 1),
        ("ttfa p50", "ttfa_ms_p50", 1),
        ("ttfa p99", "ttfa_ms_p99", 1),
        ("e2e p50", "e2e_ms_p50", 1),
        ("e2e p99", "e2e_ms_p99", 1),
    ]
    return _grid(rows, columns + _extra_columns(rows))


def format_multi_turn_table(rows: list[dict]) -> str:
    """One row per (config, turn): TTFT / TTFA percentiles, prompt size, cached prompt tokens,
    and against the same config with prefix caching off."""
    columns: list[tuple[str, str, int]] = [
        ("config", "config", 0),
        ("turn", "turn", 0),
        ("n", "num_requests", 0),
        ("err", "errors", 0),
        ("prompt chars", "prompt_chars_mean", 0),
        ("cached tokens", "cached_tokens_mean", 0),
        ("ttft p50", "ttft_ms_p50", 1),
        ("ttft p99", "ttft_ms_p99", 1),
        ("ttfa p50", "ttfa_ms_p50", 1),
        ("ttfa p99", "ttfa_ms_p99", 1),
    ]
    if any(row.get("ttft_vs_uncached") is not None for row in rows):
        columns += [("ttft vs uncached", "ttft_vs_uncached", 2), ("ttfa vs uncached", "ttfa_vs_uncached", 2)]
    return _grid(rows, columns)


def format_table(results: list[dict]) -> str:
    """One row per (config, level); latencies in ms, ratios against the same config's lowest
    level and, with several configs, against the first config at the same level."""
    configs = list(dict.fromkeys(row["config"] for row in results))
    columns: list[tuple[str, str, int]] = [
        ("config", "config", 0),
        ("conc", "concurrency", 0),
        ("n", "num_requests", 0),
        ("err", "errors", 0),
        ("req/s", "req_per_s", 2),
        ("tok/s", "output_tok_per_s", 1),
        ("ttft p50", "ttft_ms_p50", 1),
        ("ttft p99", "ttft_ms_p99", 1),
        ("ttfa p50", "ttfa_ms_p50", 1),
        ("ttfa p99", "ttfa_ms_p99", 1),
        ("itl p50", "itl_ms_p50", 2),
        ("itl p99", "itl_ms_p99", 2),
        ("e2e p50", "e2e_ms_p50", 1),
        ("e2e p99", "e2e_ms_p99", 1),
        ("rtf p50", "rtf_p50", 3),
        ("req/s vs c1", "req_per_s_vs_c1", 2),
        ("e2e p50 vs c1", "e2e_p50_vs_c1", 2),
    ]
    if any(row.get("kv_handoff_ms_mean") is not None for row in results):
        columns.append(("handoff ms", "kv_handoff_ms_mean", 2))
    if len(configs) >= 2:
        columns.append((f"req/s vs {configs[0]}", vs_config_key(configs[0]), 2))
    if any(row.get("pd_ttft_overhead_ms") is not None for row in results):
        columns.append(("P/D ttft overhead ms", "pd_ttft_overhead_ms", 1))
    return _grid(results, columns + _extra_columns(results))


def write_plot(path: str | Path, results: list[dict], *, cores: int, max_tokens: int | str) -> None:
    """Two panels against concurrency, one line per config: throughput (req/s), and e2e p50
    (solid) with TTFA p50 (dashed) in ms. `max_tokens`: a number, or the drawn lengths' spec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(config: str, key: str) -> tuple[list[int], list[float]]:
        rows = sorted((r for r in results if r["config"] == config), key=lambda r: r["concurrency"])
        return ([r["concurrency"] for r in rows], [math.nan if r.get(key) is None else r[key] for r in rows])

    configs = list(dict.fromkeys(row["config"] for row in results))
    levels = sorted({row["concurrency"] for row in results})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for n, config in enumerate(configs):
        color = f"C{n}"
        left.plot(*series(config, "req_per_s"), marker="o", color=color, label=config)
        right.plot(*series(config, "e2e_ms_p50"), marker="o", color=color, label=f"{config} e2e p50")
        right.plot(
            *series(config, "ttfa_ms_p50"),
            marker="s",
            markerfacecolor="none",
            linestyle="--",
            color=color,
            label=f"{config} TTFA p50",
        )
    for axis, ylabel, title in ((left, "requests/s", "throughput"), (right, "ms", "latency (p50)")):
        if len(levels) > 1 and levels[0] > 0:
            axis.set_xscale("log", base=2)
        axis.set_xticks(levels)
        axis.set_xticklabels([str(c) for c in levels])
        axis.set_xlabel("concurrency (requests in flight)")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    fig.suptitle(f"omni-pd bench serve: {platform.machine()}, {cores} CPU cores, max_tokens={max_tokens}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def print_errors(results_errors: dict[str, list[str]], stream=sys.stderr, limit: int = 3) -> None:
    """The first `limit` distinct error messages of each (config, level) that had errors."""
    for where, messages in results_errors.items():
        distinct = list(dict.fromkeys(messages))
        print(f"{where}: {len(messages)} failed request(s)", file=stream)
        for message in distinct[:limit]:
            print(f"  {message[:500]}", file=stream)
