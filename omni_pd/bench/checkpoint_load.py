"""`omni-pd bench load CHECKPOINT_DIR`: load a checkpoint the way each hf stage does, each stage in
a fresh process, and report per stage:
  part_bytes      the bytes of the stage's tensors (its part; the talker's includes the thinker's
                  token embedding it keeps)
  rss_growth      peak RSS (VmHWM) of the loading process minus that of a bare worker, a process
                  that imported the same modules and read the config but loaded nothing
  load_s          the stage's load (shard index, meta build, reading its tensors, buffers)
  read_GiB_s      part_bytes / load_s, against cat_GiB_s: a plain `cat` of the same shard files
                  to /dev/null, timed in the same run
Every shard is read once (untimed) first, so both the `cat` and the loads read from the page
cache: the figures are the loader's own cost, not the disk's. Mapped shard pages count in RSS
while mapped; the loader re-opens a shard every `MAP_WINDOW_BYTES`, which bounds them.
Target: rss_growth <= 1.3 x part_bytes + 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .report import run_metadata, write_json

STAGES = ("thinker", "talker", "code2wav")
TARGET_RATIO, TARGET_SLACK = 1.3, 64 * 2**20
KEYS = (
    "stage",
    "part_bytes",
    "shards_read",
    "shards_total",
    "tensors",
    "bare_peak_rss",
    "peak_rss",
    "rss_growth",
    "growth_over_part",
    "within_target",
    "load_s",
    "read_GiB_s",
    "cat_bytes",
    "cat_s",
    "cat_GiB_s",
    "read_over_cat",
    "end_rss_anon",
    "end_rss_file",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory (safetensors, sharded or not)")
    parser.add_argument(
        "--stages",
        default=",".join(STAGES),
        help=f"comma-separated model stages (default: {','.join(STAGES)})",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="write the results (and the machine) as JSON",
    )
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="draw part bytes against peak RSS growth per stage"
    )


def _memory() -> dict[str, int]:
    """Peak and current RSS of this process, in bytes (Linux /proc; ru_maxrss elsewhere)."""
    fields: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    peak = fields.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {
        "peak_rss": peak,
        "end_rss_anon": fields.get("RssAnon", 0),
        "end_rss_file": fields.get("RssFile", 0),
    }


def worker(checkpoint: str, stage: str, dtype_name: str) -> dict[str, Any]:
    """One measurement process: `stage` loads its part; `bare` imports and reads the config only."""
    import torch

    from ..models.qwen3_omni.factory import load_config, load_stage, resolve_model

    # One intra-op thread, as the CI stage workers run: a parallel copy_ on a busy 2-core machine
    # spins (seen: 9.6 s instead of 1.3 s for the thinker).
    torch.set_num_threads(1)
    load_config(resolve_model(checkpoint))
    if stage == "bare":
        return _memory()
    began = time.perf_counter()
    parts, reports = load_stage(checkpoint, stage, dtype=getattr(torch, dtype_name))
    load_s = time.perf_counter() - began
    del parts
    return {
        **_memory(),
        "load_s": load_s,
        "part_bytes": sum(r.bytes for r in reports),
        "tensors": sum(r.tensors for r in reports),
        "shards_read": sorted({s for r in reports for s in r.shards_read}),
        "shards_total": reports[0].shards_total,
    }


def _in_fresh_process(checkpoint: str, stage: str, dtype: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "omni_pd.bench.checkpoint_load", checkpoint, stage, dtype],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {stage} load failed:\n{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cat_seconds(paths: list[Path]) -> float:
    began = time.perf_counter()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - began


def run(args: argparse.Namespace) -> int:
    from ..models.checkpoint import CheckpointError, read_shard_index

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not stages or any(s not in STAGES for s in stages):
        print(f"error: --stages: choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    try:
        index = read_shard_index(args.checkpoint)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _cat_seconds([index.directory / s for s in index.shards])  # warm the page cache (untimed)
    bare = _in_fresh_process(args.checkpoint, "bare", args.dtype)
    results = []
    for stage in stages:
        row = {"stage": stage, **_in_fresh_process(args.checkpoint, stage, args.dtype)}
        files = [index.directory / s for s in row["shards_read"]]
        row["shards_read"] = len(files)
        row["cat_bytes"] = sum(f.stat().st_size for f in files)
        row["cat_s"] = _cat_seconds(files)
        row["bare_peak_rss"] = bare["peak_rss"]
        row["rss_growth"] = row["peak_rss"] - bare["peak_rss"]
        row["growth_over_part"] = row["rss_growth"] / row["part_bytes"]
        row["within_target"] = row["rss_growth"] <= TARGET_RATIO * row["part_bytes"] + TARGET_SLACK
        row["read_GiB_s"] = row["part_bytes"] / row["load_s"] / 2**30
        row["cat_GiB_s"] = row["cat_bytes"] / row["cat_s"] / 2**30
        row["read_over_cat"] = row["read_GiB_s"] / row["cat_GiB_s"]
        results.append({k: row[k] for k in KEYS})
    print(format_table(results))
    if args.json_path:
        write_json(
            args.json_path,
            run_metadata(
                sys.argv, checkpoint=str(index.directory), dtype=args.dtype, shards=len(index.shards)
            ),
            results,
        )
        print(f"wrote {args.json_path}")
    if args.plot:
        write_plot(args.plot, results)
        print(f"wrote {args.plot}")
    return 0 if all(r["within_target"] for r in results) else 1


def format_table(results: list[dict[str, Any]]) -> str:
    mib = 2**20
    columns = [
        ("stage", lambda r: r["stage"]),
        ("part MiB", lambda r: f"{r['part_bytes'] / mib:.1f}"),
        ("shards", lambda r: f"{r['shards_read']}/{r['shards_total']}"),
        ("peak RSS growth MiB", lambda r: f"{r['rss_growth'] / mib:.1f}"),
        ("growth/part", lambda r: f"{r['growth_over_part']:.2f}"),
        ("target MiB", lambda r: f"{(TARGET_RATIO * r['part_bytes'] + TARGET_SLACK) / mib:.1f}"),
        ("load s", lambda r: f"{r['load_s']:.2f}"),
        ("read GiB/s", lambda r: f"{r['read_GiB_s']:.2f}"),
        ("cat GiB/s", lambda r: f"{r['cat_GiB_s']:.2f}"),
        ("read/cat", lambda r: f"{r['read_over_cat']:.2f}"),
    ]
    cells = [[title for title, _ in columns]] + [[cell(r) for _, cell in columns] for r in results]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(path: str | Path, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    names = [r["stage"] for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["part_bytes"] / mib for r in results], 0.4, label="part")
    ax.bar([i + 0.2 for i in x], [r["rss_growth"] / mib for r in results], 0.4, label="peak RSS growth")
    ax.scatter(
        list(x),
        [(TARGET_RATIO * r["part_bytes"] + TARGET_SLACK) / mib for r in results],
        marker="_",
        s=600,
        color="black",
        label="target (1.3 x part + 64 MiB)",
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB")
    ax.set_title("hf stage checkpoint loads, each in a fresh process")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # one measurement process: CHECKPOINT STAGE|bare DTYPE
    print(json.dumps(worker(*sys.argv[1:4])))
