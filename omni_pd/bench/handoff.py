"""`omni-pd bench handoff`: the P/D KV handoff against what the wire and memory allow, in one run.

For each KV geometry and prompt length, over each path (`tcp`: Mooncake on loopback; `shm`: the
same-host path, the prefill's pool in shared memory that the decode side maps; on a GPU host,
`cuda_ipc`: both pools on cuda:0, the decode side copying device to device out of the
prefill's pool by CUDA IPC handle, and `staged`: both pools on cuda:0, the KV through pinned
host copies over Mooncake tcp, as across hosts with a CPU-only Mooncake), it times:
  memcpy_ms   an in-process copy of the same bytes (the floor no transport beats; device to
              device for the GPU paths)
  wire_ms     one raw Mooncake read of the same bytes between two registered buffers
  handoff_ms  the handoff as the engines run it, all of it: the prefill side's checksums (taken
              block by block as its cache is written: sender_checksum_ms, what they add to that
              write), publishing the cache blocks as they are, and the decode side reading them
              into blocks of its own paged cache and verifying them (publish_ms + fetch_ms)
and reports handoff_over_wire and handoff_over_memcpy, and entries (Mooncake transfer entries
the read took). Medians over `--repeats`. The handoff is checked to move the bytes unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from ..engines.core.paged_cache import PagedKVCache  # noqa: E402
from ..kv import BlockLayout, KVReceiver, KVSender, open_transport  # noqa: E402
from ..kv.pool import BlockPool  # noqa: E402
from .report import run_metadata  # noqa: E402


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str


GEOMETRIES = {
    "tiny": Geometry("tiny-qwen3-omni thinker", 4, 2, 16, "float32"),
    "30b": Geometry("Qwen3-Omni-30B-A3B thinker", 48, 4, 128, "bfloat16"),
}
PATHS = ("tcp", "shm", "cuda_ipc", "staged")
# `--path push,pull`: when the decode side can start in each transfer mode (handoff_push.py).
MODE_PATHS = ("push", "pull")
DEFAULT_PATHS = ("tcp", "shm")
GPU_PATHS = ("cuda_ipc", "staged")
_READ_PATH = {"tcp": "tcp", "shm": "shm", "cuda_ipc": "cuda_ipc", "staged": "tcp"}  # FetchResult.path
DEFAULT_TOKENS = (256, 1024, 4096)
QUICK_TOKENS = (256,)
KEYS = (
    "geometry",
    "tokens",
    "path",
    "bytes",
    "entries",
    "memcpy_ms",
    "wire_ms",
    "sender_checksum_ms",
    "publish_ms",
    "fetch_ms",
    "handoff_ms",
    "handoff_over_wire",
    "handoff_over_memcpy",
)
# How the bench polls a read: the decode engine's fast poll interval while a read is young.
_POLL_S = 0.0002


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--geometries",
        default="tiny,30b",
        help=f"comma-separated KV geometries: {', '.join(GEOMETRIES)} (default: all)",
    )
    parser.add_argument(
        "--tokens", default=None, help="comma-separated prompt lengths (default: 256,1024,4096; --quick: 256)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--path",
        default=",".join(DEFAULT_PATHS),
        help=f"comma-separated paths: {', '.join(PATHS)} (default: "
        f"{','.join(DEFAULT_PATHS)}; {' and '.join(GPU_PATHS)} need a CUDA GPU; "
        "in this bench both sides are one process, so a CUDA IPC handle "
        "resolves to the pool itself: the copy is timed, not the opening); or the transfer "
        "modes push,pull (Mooncake tcp): when the decode side can start, with a modelled prefill",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=None,
        help="push,pull: the modelled prefill compute, microseconds per prompt token (default 15: "
        "the 30B-A3B thinker on a GPU sustaining ~400 TFLOP/s)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="push: prompt positions per chunk written while the next computes (default 512, "
        "kv_push_chunk_tokens' default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per measurement, median reported (default 5; --quick: 2)",
    )
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--quick", action="store_true", help="CI mode: 256 tokens, 2 repeats (explicit options still win)"
    )


def _median_ms(fn: Callable[[], Any], repeats: int, reset: Callable[[], Any] | None = None) -> float:
    """Median wall time of fn over `repeats` runs after one warm-up (a peer's first contact
    handshakes); `reset` runs untimed after each."""
    times = []
    for index in range(repeats + 1):
        began = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - began) * 1e3
        if index:
            times.append(elapsed)
        if reset is not None:
            reset()
    return statistics.median(times)


class _Pair:
    """A prefill and a decode side, each with its paged-cache pool registered with its own
    Mooncake engine, as the P/D engines run. `path` "shm": the prefill's pool is shared memory and
    the decode side insists on mapping it; "tcp": plain pools, Mooncake only."""

    def __init__(self, layout: BlockLayout, blocks: int, path: str):
        self.path = path
        self.device = "cuda:0" if path in GPU_PATHS else "cpu"
        self.sender_transport, self.receiver_transport = (
            open_transport("127.0.0.1", "tcp"),
            open_transport("127.0.0.1", "tcp"),
        )
        # the prefill engine's
        self.cache = PagedKVCache(layout, blocks, shared=path in ("shm", "cuda_ipc"), device=self.device)
        staged = "cpu" if path == "staged" else None
        self.sender = KVSender(
            "bench-prefill",
            layout,
            self.cache.pool,
            self.sender_transport,
            lease_timeout_s=600,
            buffer_device=staged,
            same_host=path in ("shm", "cuda_ipc"),
        )
        self.receiver = KVReceiver(
            layout,
            BlockPool(layout, blocks, device=self.device),
            self.receiver_transport,
            buffer_device=staged,
            same_host=path if path in ("shm", "cuda_ipc") else "off",
        )
        self.layout = layout

    def measure(self, tokens: int, repeats: int) -> dict[str, Any]:
        layout, sender, receiver = self.layout, self.sender, self.receiver
        kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim).to(
            device=self.device, dtype=layout.torch_dtype
        )
        dest = receiver.pool.allocate(layout.num_blocks_for(tokens))  # the decode's cache blocks
        state: dict[str, Any] = {"n": 0}

        def prefill() -> None:
            """The prefill's KV written into blocks of its cache, checksummed as written (the
            cache write is the prefill's own work; what the checksums add is timed apart)."""
            state["source"] = self.cache.allocate(tokens)
            state["sums"] = self.cache.write(state["source"], 0, kv, checksums=True)

        def publish() -> None:
            state["published"] = True
            state["n"] += 1
            state["tid"] = f"bench-{tokens}-{state['n']}"
            state["descriptor"] = sender.publish_blocks(
                state["tid"], state["source"], tokens, checksums=state["sums"]
            )

        def fetch() -> None:
            receiver.start(state["descriptor"], into=dest)
            while (result := receiver.poll(state["tid"])) is None:
                time.sleep(_POLL_S)
            if result.path != _READ_PATH[self.path]:
                raise AssertionError(f"the {self.path} path moved the KV by {result.path}")
            _sync(self.device)
            state["entries"] = result.num_segments

        def handoff() -> None:
            publish()
            fetch()

        def release() -> None:
            """The decode side's ack frees the leased blocks; the next run prefills anew."""
            sender.release(state["tid"])
            state["published"] = False
            prefill()

        prefill()
        try:
            blocks = state["source"]
            checksum_ms = max(
                0.0,
                _median_ms(lambda: self.cache.write(blocks, 0, kv, checksums=True), repeats)
                - _median_ms(lambda: self.cache.write(blocks, 0, kv), repeats),
            )
            handoff_ms = checksum_ms + _median_ms(handoff, repeats, release)
            publish()
            got = receiver.pool.gather(dest).reshape(-1)[: tokens * layout.bytes_per_token]
            sent = sender.pool.gather(state["source"]).reshape(-1)[: tokens * layout.bytes_per_token]
            release()
            if not torch.equal(got, sent):
                raise AssertionError("the handoff changed the KV bytes")
            publish_ms = _median_ms(publish, repeats, release)
            publish()
            fetch_ms = _median_ms(fetch, repeats)
            release()
        finally:
            if state.get("published"):  # a failed run: the lease goes first, then the blocks
                sender.release(state["tid"])
            self.cache.release(state["source"])
            receiver.pool.free(dest)
        return {
            "handoff_ms": handoff_ms,
            "sender_checksum_ms": checksum_ms,
            "publish_ms": publish_ms,
            "fetch_ms": fetch_ms,
            "entries": state["entries"],
        }

    def wire_ms(self, nbytes: int, repeats: int) -> float:
        src = torch.zeros(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.sender_transport.register(src.data_ptr(), nbytes)
        self.receiver_transport.register(dst.data_ptr(), nbytes)
        try:
            return _median_ms(
                lambda: self.receiver_transport.read(
                    self.sender_transport.session_id, [(dst.data_ptr(), src.data_ptr(), nbytes)]
                ),
                repeats,
            )
        finally:
            self.sender_transport.unregister(src.data_ptr())
            self.receiver_transport.unregister(dst.data_ptr())

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def memcpy_ms(nbytes: int, repeats: int, device: str = "cpu") -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src)
        _sync(device)

    return _median_ms(copy, repeats)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    names = [g.strip() for g in args.geometries.split(",") if g.strip()]
    unknown = [g for g in names if g not in GEOMETRIES]
    if unknown or not names:
        print(
            f"error: --geometries: unknown {unknown or names}; choose from {list(GEOMETRIES)}",
            file=sys.stderr,
        )
        return 2
    try:
        tokens = (
            tuple(int(t) for t in args.tokens.split(","))
            if args.tokens
            else QUICK_TOKENS
            if args.quick
            else DEFAULT_TOKENS
        )
    except ValueError:
        print(f"error: --tokens: expected comma-separated integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    repeats = args.repeats or (2 if args.quick else 5)
    paths = [p.strip() for p in args.path.split(",") if p.strip()]
    if paths and all(p in MODE_PATHS for p in paths):
        return _run_modes(args, names, tokens, repeats, paths)
    if not paths or any(p not in PATHS for p in paths):
        print(f"error: --path: expected some of {list(PATHS)}, got {args.path!r}", file=sys.stderr)
        return 2
    if any(p in GPU_PATHS for p in paths) and not torch.cuda.is_available():
        print(
            f"error: --path {','.join(p for p in paths if p in GPU_PATHS)} needs a CUDA GPU, and "
            "torch sees none here; use --path tcp,shm",
            file=sys.stderr,
        )
        return 2
    if min(tokens) < 1 or repeats < 1 or args.block_size < 1:
        print("error: --tokens, --repeats and --block-size must be positive", file=sys.stderr)
        return 2
    results = []
    with tqdm(total=len(names) * len(tokens), desc="bench handoff", unit="case", file=sys.stderr) as bar:
        for name in names:
            g = GEOMETRIES[name]
            layout = BlockLayout.default_for(
                g.layers, g.kv_heads, g.head_dim, g.dtype, block_size=args.block_size
            )
            pairs = [_Pair(layout, layout.num_blocks_for(max(tokens)) + 1, path) for path in paths]
            try:
                for count in tokens:
                    nbytes = count * layout.bytes_per_token
                    # The baselines once per size, in the same run: both paths are held to them.
                    base = {
                        "memcpy_ms": {d: memcpy_ms(nbytes, repeats, d) for d in {p.device for p in pairs}},
                        "wire_ms": pairs[0].wire_ms(nbytes, repeats),
                    }
                    for pair in pairs:
                        row = {
                            "geometry": g.name,
                            "tokens": count,
                            "path": pair.path,
                            "bytes": nbytes,
                            "memcpy_ms": base["memcpy_ms"][pair.device],
                            "wire_ms": base["wire_ms"],
                            **pair.measure(count, repeats),
                        }
                        row["handoff_over_wire"] = row["handoff_ms"] / row["wire_ms"]
                        row["handoff_over_memcpy"] = row["handoff_ms"] / row["memcpy_ms"]
                        results.append({k: row[k] for k in KEYS})
                    bar.update()
            finally:
                for pair in pairs:
                    pair.close()
    _print_table(results)
    if args.json_path:
        report = {**run_metadata(sys.argv, repeats=repeats, block_size=args.block_size), "results": results}
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0


def _run_modes(
    args: argparse.Namespace, names: list[str], tokens: tuple[int, ...], repeats: int, modes: list[str]
) -> int:
    from . import handoff_push

    us = args.prefill_us_per_token
    us = handoff_push.DEFAULT_PREFILL_US_PER_TOKEN if us is None else us
    chunk = args.chunk_tokens or handoff_push.DEFAULT_CHUNK_TOKENS
    if us < 0 or chunk < 1 or min(tokens) < 1 or args.block_size < 1:
        print(
            "error: --prefill-us-per-token must be >= 0, --chunk-tokens, --tokens and --block-size positive",
            file=sys.stderr,
        )
        return 2
    chunk = -(-chunk // args.block_size) * args.block_size  # chunks end on block boundaries
    rows = []
    for name in names:
        g = GEOMETRIES[name]
        layout = BlockLayout.default_for(
            g.layers, g.kv_heads, g.head_dim, g.dtype, block_size=args.block_size
        )
        for count in tokens:
            row = handoff_push.measure(layout, count, modes, repeats, us, chunk)
            rows.append({"geometry": g.name, **row})
    handoff_push.print_table(rows)
    if args.json_path:
        meta = run_metadata(
            sys.argv, repeats=repeats, block_size=args.block_size, prefill_us_per_token=us, chunk_tokens=chunk
        )
        Path(args.json_path).write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0


def _print_table(results: list[dict[str, Any]]) -> None:
    columns = [
        ("geometry", "geometry", "{}"),
        ("tokens", "tokens", "{}"),
        ("path", "path", "{}"),
        ("MiB", "bytes", "{:.2f}"),
        ("entries", "entries", "{}"),
        ("memcpy ms", "memcpy_ms", "{:.2f}"),
        ("wire ms", "wire_ms", "{:.2f}"),
        ("checksum ms", "sender_checksum_ms", "{:.2f}"),
        ("publish ms", "publish_ms", "{:.2f}"),
        ("fetch ms", "fetch_ms", "{:.2f}"),
        ("handoff ms", "handoff_ms", "{:.2f}"),
        ("/wire", "handoff_over_wire", "{:.2f}"),
        ("/memcpy", "handoff_over_memcpy", "{:.2f}"),
    ]
    rows = [
        [fmt.format(r[key] / 2**20 if key == "bytes" else r[key]) for _, key, fmt in columns] for r in results
    ]
    widths = [max(len(title), *(len(row[i]) for row in rows)) for i, (title, _, _) in enumerate(columns)]
    print(
        "  ".join(
            title.ljust(w) if i < 3 else title.rjust(w)
            for i, ((title, _, _), w) in enumerate(zip(columns, widths))
        )
    )
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(
            "  ".join(
                cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
