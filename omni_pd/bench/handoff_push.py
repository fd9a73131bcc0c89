"""`omni-pd bench handoff --path push,pull`: when the decode side can start, push against pull.

Both sides run the engines' KV code (KVSender / KVReceiver for pull, KVPusher /
PushReservations for push) over Mooncake tcp on loopback, in one process. The prefill's compute
is a stated model, not a model run: `--prefill-us-per-token` microseconds per prompt token
(spread evenly over the layers; default 15 us, the 30B-A3B thinker's ~3B active parameters at
~6 GFLOP per token on a GPU sustaining ~400 TFLOP/s in bf16), during which the CPU is idle, as
it is while a GPU computes; the KV each chunk produces is really written into the prefill's
paged cache (and checksummed as the engines do).

  prefill_ms  the modelled compute plus the cache writes: colocated's time to its first token
  pull_ms     prefill, then publish and a read into the decode side's blocks, verified
  push_ms     reserve, then the prefill in `--chunk-tokens` chunks with each chunk's blocks
              written to the decode side while the next computes, then the last writes and the
              decode side's verification
  *_over_ms   the P/D overhead over colocated (pull_ms or push_ms minus prefill_ms)
  hidden      the share of pull's transfer that push hides behind compute (1 - push / pull
              overhead)
Medians over --repeats, all in one run (ratios are what to compare on a shared machine).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..engines.core.paged_cache import PagedKVCache
from ..kv import BlockLayout, KVReceiver, KVSender, open_transport
from ..kv.pool import BlockPool
from ..kv.push import KVPusher, PushReservations

MODES = ("push", "pull")
DEFAULT_PREFILL_US_PER_TOKEN = 15.0
DEFAULT_CHUNK_TOKENS = 512
_POLL_S = 0.0002


class PushPullPair:
    """A prefill side (paged cache registered with its Mooncake engine) and a decode side (a
    registered pool), set up for both modes, as the P/D engines are."""

    def __init__(self, layout: BlockLayout, blocks: int):
        self.layout = layout
        self.prefill_transport, self.decode_transport = (
            open_transport("127.0.0.1", "tcp"),
            open_transport("127.0.0.1", "tcp"),
        )
        self.cache = PagedKVCache(layout, blocks)
        self.sender = KVSender("bench-prefill", layout, self.cache.pool, self.prefill_transport, 600)
        self.receiver = KVReceiver(layout, BlockPool(layout, blocks), self.decode_transport, same_host="off")
        self.pusher = KVPusher(
            self.prefill_transport, self.cache.pool, self.sender.landing, self.cache.release
        )
        self.reservations = PushReservations(
            self.decode_transport.session_id,
            self.receiver.pool,
            self.receiver.landing,
            self.receiver.pool.free,
            fence_s=60,
        )
        self._n = 0

    def _compute(self, kv: torch.Tensor, start: int, end: int, us_per_token: float) -> torch.Tensor:
        """The modelled prefill of positions start..end: idle CPU for its compute time."""
        time.sleep((end - start) * us_per_token * 1e-6)
        return kv[:, :, :, start:end]

    def prefill_only(self, kv: torch.Tensor, us_per_token: float, chunk: int) -> float:
        tokens = kv.shape[3]
        began = time.perf_counter()
        blocks = self.cache.allocate(tokens)
        self.cache.write(blocks, 0, self._compute(kv, 0, tokens, us_per_token), checksums=True)
        elapsed = time.perf_counter() - began
        self.cache.release(blocks)
        return elapsed * 1e3

    def pull(self, kv: torch.Tensor, us_per_token: float, chunk: int) -> float:
        tokens = kv.shape[3]
        self._n += 1
        tid = f"pull-{self._n}"
        dest = self.receiver.pool.allocate(self.layout.num_blocks_for(tokens))
        began = time.perf_counter()
        blocks = self.cache.allocate(tokens)
        sums = self.cache.write(blocks, 0, self._compute(kv, 0, tokens, us_per_token), checksums=True)
        descriptor = self.sender.publish_blocks(tid, blocks, tokens, checksums=sums)
        self.receiver.start(descriptor, into=dest)
        while (result := self.receiver.poll(tid)) is None:
            time.sleep(_POLL_S)
        elapsed = time.perf_counter() - began
        self.sender.release(tid)
        self._check(blocks, result.blocks, tokens)
        self.receiver.pool.free(result.blocks)
        return elapsed * 1e3

    def push(self, kv: torch.Tensor, us_per_token: float, chunk: int) -> float:
        tokens = kv.shape[3]
        self._n += 1
        tid = f"push-{self._n}"
        began = time.perf_counter()
        dest = self.receiver.pool.allocate(self.layout.num_blocks_for(tokens))
        target = self.reservations.reserve(tid, dest, 0, tokens, wait_s=60)
        blocks = self.cache.allocate(tokens)
        self.pusher.start(target, blocks)
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            self.cache.write(blocks, start, self._compute(kv, start, end, us_per_token))
            self.pusher.send(tid, end)
        checksums, _ = self.pusher.finish(tid)
        reservation = self.reservations.take(tid, checksums)
        elapsed = time.perf_counter() - began
        self._check(blocks, reservation.blocks, tokens)
        self.cache.release(blocks)
        self.receiver.pool.free(reservation.blocks)
        return elapsed * 1e3

    def _check(self, source: list[int], dest: list[int], tokens: int) -> None:
        n = tokens * self.layout.bytes_per_token
        sent = self.cache.pool.gather(source).reshape(-1)[:n]
        got = self.receiver.pool.gather(dest).reshape(-1)[:n]
        if not torch.equal(sent, got):
            raise AssertionError("the handoff changed the KV bytes")

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def measure(
    layout: BlockLayout, tokens: int, modes: list[str], repeats: int, us_per_token: float, chunk: int
) -> dict[str, Any]:
    """One row: the medians of each mode and of the prefill alone, interleaved run by run (so
    load from other processes falls on all of them alike)."""
    pair = PushPullPair(layout, 2 * layout.num_blocks_for(tokens) + 2)
    kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim).to(
        layout.torch_dtype
    )
    runs: dict[str, list[float]] = {"prefill": [], **{m: [] for m in modes}}
    try:
        for index in range(repeats + 1):  # the first round warms up (a first contact handshakes)
            for name in runs:
                ms = getattr(pair, "prefill_only" if name == "prefill" else name)(kv, us_per_token, chunk)
                if index:
                    runs[name].append(ms)
    finally:
        pair.close()
    row: dict[str, Any] = {"tokens": tokens, "bytes": tokens * layout.bytes_per_token, "chunk_tokens": chunk}
    row["prefill_ms"] = statistics.median(runs["prefill"])
    for mode in modes:
        row[f"{mode}_ms"] = statistics.median(runs[mode])
        row[f"{mode}_over_ms"] = row[f"{mode}_ms"] - row["prefill_ms"]
    if set(modes) == set(MODES):
        row["push_over_pull"] = row["push_over_ms"] / row["pull_over_ms"]
        row["hidden"] = 1 - row["push_over_pull"]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = [k for k in rows[0] if k != "geometry"]
    print("  ".join(["geometry".ljust(28), *(k.rjust(max(len(k), 10)) for k in keys)]))
    for row in rows:
        cells = [
            f"{row[k]:.3f}"
            if isinstance(row[k], float) and abs(row[k]) < 10
            else f"{row[k]:.1f}"
            if isinstance(row[k], float)
            else str(row[k])
            for k in keys
        ]
        print(
            "  ".join([row["geometry"].ljust(28), *(c.rjust(max(len(k), 10)) for c, k in zip(cells, keys))])
        )
