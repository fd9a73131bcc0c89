"""GPU probe: can the hf engines' tiled linear layer (engines/hf/batch_invariant.py `linear`, one
`F.linear` per 16-row tile) run its tiles as one batched product per group of G tiles, and keep a
row's bits whatever else is in the batch?

Why: on the first GPU run (scripts/gpu_check.sh, 2026-11-28) a 2,048-token prefill at the real
thinker's shapes took 0.69 s on an H100 against a 0.85 ms roofline: one kernel per 16-row tile and
per routed expert. A product of G tiles at once has a fixed batch count G, so cuBLAS would pick one
kernel for it whatever the batch holds. This script measures whether a row's bits hold under it
(against the row alone, in many batch sizes and positions), and what it costs against the loop and
against plain `F.linear` (the negative control, which is not batch-invariant), at the real
thinker's projection shapes. It changes nothing in the engines; it prints what a GPU shows.

    python scripts/gpu_tiles_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

TILE = 16
SHAPES = {  # (in, out) of the real thinker's layers (Qwen3-Omni-30B-A3B)
    "q_proj": (2048, 4096),
    "k_proj": (2048, 512),
    "o_proj": (4096, 2048),
    "expert gate_up": (2048, 1536),
    "expert down": (768, 2048),
}
COUNTS = (1, 2, 7, 15, 16, 17, 33, 64, 127, 300, 1024, 2048)


def tile_loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    count = x.shape[0]
    padded = max(TILE, -(-count // TILE) * TILE)
    rows = F.pad(x, (0, 0, 0, padded - count))
    return torch.cat([F.linear(rows[i : i + TILE], w) for i in range(0, padded, TILE)])[:count]


def grouped(group: int):
    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        count = x.shape[0]
        span = TILE * group
        padded = max(span, -(-count // span) * span)
        rows = F.pad(x, (0, 0, 0, padded - count)).view(-1, group, TILE, x.shape[1])
        wt = w.t()
        return torch.cat([torch.matmul(rows[g], wt).reshape(span, -1) for g in range(rows.shape[0])])[:count]

    return run


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def invariant(method, w: torch.Tensor, dev: str, dtype: torch.dtype, seed: int) -> bool:
    gen = torch.Generator().manual_seed(seed)
    k = w.shape[1]
    row = torch.randn(1, k, generator=gen, device="cpu").to(dev, dtype)
    alone = method(row, w)[0]
    for count in COUNTS:
        for position in {0, count // 2, count - 1}:
            batch = torch.randn(count, k, generator=gen, device="cpu").to(dev, dtype)
            batch[position] = row[0]
            if not torch.equal(method(batch, w)[position], alone):
                return False
    return True


def timed_ms(method, x: torch.Tensor, w: torch.Tensor, repeats: int = 10) -> float:
    for _ in range(2):
        method(x, w)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        method(x, w)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_tiles_probe: no CUDA device here")
        return 2
    dev = "cuda:0"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    methods = {"tile loop": tile_loop, "groups of 8": grouped(8), "groups of 32": grouped(32), "plain": plain}
    rows = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'dtype':9} {'layer':15} " + " ".join(f"{m:>22}" for m in methods))
    for dtype in (torch.float32, torch.bfloat16):
        for index, (layer, (k, n)) in enumerate(SHAPES.items()):
            gen = torch.Generator().manual_seed(index)
            w = torch.randn(n, k, generator=gen, device="cpu").to(dev, dtype)
            x = torch.randn(2048, k, generator=gen, device="cpu").to(dev, dtype)
            cells = []
            for name, method in methods.items():
                same = invariant(method, w, dev, dtype, 100 + index)
                ms = timed_ms(method, x, w)
                rows.append(
                    {
                        "dtype": str(dtype),
                        "layer": layer,
                        "method": name,
                        "invariant": same,
                        "ms_2048_rows": ms,
                    }
                )
                cells.append(f"{'exact' if same else 'VARIES':>6} {ms:8.3f} ms/2048r")
            print(f"{str(dtype).removeprefix('torch.'):9} {layer:15} " + " ".join(f"{c:>22}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
