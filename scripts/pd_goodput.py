"""Issue 47's experiment: does P/D pay? 1P1D against colocated replicas on the same two cores, at
the real model's shapes (a one-layer real-shape checkpoint), thinker only, under two SLO pairs
set from step costs measured in the same run.

    .venv/bin/python scripts/pd_goodput.py --model /tmp/real1 \\
        --json docs/bench_pd_goodput.json --plot docs/bench_pd_goodput.png

1. Step costs: `omni-pd bench roofline` with one thread pinned to core 0: the prefill of the
   median prompt, and a decode step at batch 8 at the median context.
2. SLO pairs from them: tight (ITL <= 1.25 x decode@8, TTFT <= 5 x prefill) and loose (ITL <= 3 x,
   TTFT <= 2 x). The ITL SLO is judged on each request's mean time per output token (TPOT).
3. `omni-pd bench serve --text-only` on each layout, every one with the same cores (runtime.cpus):
   1P1D (prefill on core 0, decode on core 1), colocated-2x (a replica per core, chunked prefill,
   one run per chunk budget: the fair baseline is its best budget under each SLO pair), and
   colocated-1x (one replica, both cores, two threads). Seeded Poisson arrivals at each rate, the
   same seeded prompt and output lengths for every layout (`--ignore-eos`: exact lengths).
4. Goodput (requests per second within both SLOs) per layout, rate and SLO pair, computed from
   each request's TTFT and TPOT in bench serve's JSON; the JSON and a goodput-against-rate plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OMNI_PD = str(REPO / ".venv" / "bin" / "omni-pd")
THINKER = REPO / "stage_configs" / "ci" / "qwen3_omni_tiny_thinker.yaml"
THINKER_PD = REPO / "stage_configs" / "ci" / "qwen3_omni_tiny_thinker_pd.yaml"
PAIRS = {"tight": (1.25, 5.0), "loose": (3.0, 2.0)}  # (x decode step at batch 8, x prefill)
KV_POOL_BLOCKS = 4096  # 64 Ki tokens a worker: the workload never waits for blocks


def uniform(spec: str) -> tuple[int, int]:
    kind, low, high = spec.split(":")
    assert kind == "uniform", spec
    return int(low), int(high)


def step_costs(args: argparse.Namespace, scratch: Path) -> dict:
    """Prefill of the median prompt and a decode step at batch 8 (median context), one thread
    pinned to core 0."""
    prompt, output = (statistics.median(range(a, b + 1)) for a, b in map(uniform, (args.prompt, args.output)))
    prompt, context = int(prompt), int(prompt + output / 2)
    out = scratch / "roofline.json"
    subprocess.run(
        ["taskset", "-c", "0", OMNI_PD, "bench", "roofline", args.model,
         "--stages", "thinker_prefill,thinker_decode", "--prefill-tokens", str(prompt),
         "--prefill-batches", "1", "--batches", "8", "--contexts", str(context),
         "--repeats", "2", "--json", str(out)],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    prefill = next(r for r in rows if r["stage"] == "thinker_prefill")["step_ms"]
    decode = next(r for r in rows if r["stage"] == "thinker_decode" and r["batch"] == 8)["step_ms"]
    return {"median_prompt": prompt, "context": context, "prefill_ms": prefill, "decode_b8_ms": decode}


def slo_pairs(costs: dict) -> dict[str, dict[str, float]]:
    return {
        name: {"itl_ms": itl * costs["decode_b8_ms"], "ttft_ms": ttft * costs["prefill_ms"]}
        for name, (itl, ttft) in PAIRS.items()
    }


def _stage_args(data: dict, **engine_args) -> None:
    for stage in data["stage_args"]:
        stage["engine_args"].update(load_format="auto", kv_pool_blocks=KV_POOL_BLOCKS, **engine_args)


def configs(budgets: list[int], scratch: Path) -> list[tuple[str, Path]]:
    """(label, config) of each layout, all on cores 0-1."""
    made: list[tuple[str, dict]] = []
    pd = yaml.safe_load(THINKER_PD.read_text())
    _stage_args(pd)
    for stage, cpus in zip(pd["stage_args"], ("0", "1")):
        stage.setdefault("runtime", {})["cpus"] = cpus
    made.append(("1P1D", pd))
    for budget in budgets:
        colocated = yaml.safe_load(THINKER.read_text())
        _stage_args(colocated, max_num_batched_tokens=budget)
        colocated["stage_args"][0]["runtime"].update(num_replicas=2, cpus=["0", "1"])
        made.append((f"colocated-2x_b{budget}", colocated))
    single = yaml.safe_load(THINKER.read_text())
    _stage_args(single, max_num_batched_tokens=budgets[len(budgets) // 2])
    single["stage_args"][0]["runtime"].update(cpus="0-1")  # one worker, two threads
    made.append(("colocated-1x", single))
    out = []
    for label, data in made:
        path = scratch / f"{label}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        out.append((label, path))
    return out


def bench(args: argparse.Namespace, targets: list[tuple[str, Path]], slos: dict, scratch: Path) -> dict:
    out = scratch / "serve.json"
    tight = slos["tight"]
    subprocess.run(
        [OMNI_PD, "bench", "serve", "--configs", ",".join(str(p) for _, p in targets),
         "--model", args.model, "--text-only",
         "--concurrency", "1", "--num-requests", "1", "--request-rate", args.rates,
         "--open-loop-requests", str(args.requests), "--prompt-tokens", args.prompt,
         "--output-tokens", args.output, "--ignore-eos", "--seed", str(args.seed),
         "--slo-ttft-ms", f"{tight['ttft_ms']:.0f}", "--slo-itl-ms", f"{tight['itl_ms']:.0f}",
         "--request-timeout", "1800", "--startup-timeout", "900", "--json", str(out)],
        check=True,
    )  # fmt: skip
    return json.loads(out.read_text())


def goodput(row: dict, slo: dict[str, float]) -> float:
    """Requests per second of the row's wall time within both SLOs (a one-token answer has no
    TPOT to miss)."""
    within = [
        r
        for r in row["requests"]
        if r["ok"]
        and r["ttft_ms"] is not None
        and r["ttft_ms"] <= slo["ttft_ms"]
        and (r["tpot_ms"] is None or r["tpot_ms"] <= slo["itl_ms"])
    ]
    return len(within) / row["wall_s"]


def analyse(serve: dict, slos: dict) -> dict:
    """Goodput per layout, rate and pair; the best colocated-2x budget per pair; 1P1D against it
    and against colocated-1x, each at its best rate; the crossover rate."""
    table: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for row in serve["open_loop"]:
        for pair, slo in slos.items():
            table.setdefault(row["config"], {}).setdefault(pair, []).append(
                (row["request_rate"], goodput(row, slo))
            )
    summary = {}
    for pair in slos:
        best = {label: max(g for _, g in rows[pair]) for label, rows in table.items()}
        colocated = {k: v for k, v in best.items() if k.startswith("colocated-2x_b")}
        fair = max(colocated, key=lambda k: colocated[k])
        pd_rows, fair_rows = dict(table["1P1D"][pair]), dict(table[fair][pair])
        wins = [rate for rate in sorted(pd_rows) if pd_rows[rate] > fair_rows.get(rate, 0.0)]
        summary[pair] = {
            "best_goodput": best,
            "fair_baseline": fair,
            "pd_vs_fair": best["1P1D"] / best[fair] if best[fair] else None,
            "pd_vs_colocated_1x": best["1P1D"] / best["colocated-1x"] if best["colocated-1x"] else None,
            "rates_where_pd_wins": wins,
        }
    return {"goodput": table, "summary": summary}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["slos"]), figsize=(12, 4.5), sharey=True)
    for ax, (pair, slo) in zip(axes, result["slos"].items()):
        for label, pairs in result["goodput"].items():
            rates, values = zip(*sorted(pairs[pair]))
            style = "--" if label.startswith("colocated-2x_b") else "-"
            width = 2.5 if label == "1P1D" or label == result["summary"][pair]["fair_baseline"] else 1.2
            ax.plot(rates, values, style, marker="o", linewidth=width, label=label)
        top = max(max(r for r, _ in pairs[pair]) for pairs in result["goodput"].values())
        ax.plot([0, top], [0, top], ":", color="grey", linewidth=0.8, label="offered")
        ax.set_title(f"{pair}: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['itl_ms']:.0f} ms")
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput (req/s within both SLOs)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("Thinker at real shapes (1 layer), 2 cores: 1P1D vs colocated")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="`omni-pd make-tiny-model DIR --size real --layers 1`")
    parser.add_argument("--prompt", default="uniform:256:1024", help="prompt lengths (bench serve's form)")
    parser.add_argument("--output", default="uniform:16:48", help="output lengths")
    parser.add_argument("--rates", default="0.15,0.3,0.45,0.65", help="offered rates, req/s")
    parser.add_argument("--requests", type=int, default=12, help="requests per rate")
    parser.add_argument("--budgets", default="128,512,2048", help="colocated chunk budgets swept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pd-goodput-") as tmp:
        scratch = Path(tmp)
        costs = step_costs(args, scratch)
        slos = slo_pairs(costs)
        print(f"step costs {costs}\nSLO pairs {slos}", file=sys.stderr)
        targets = configs([int(b) for b in args.budgets.split(",")], scratch)
        serve = bench(args, targets, slos, scratch)
    result = {"command": " ".join(sys.argv), "step_costs": costs, "slos": slos, **analyse(serve, slos)}
    result["serve"] = serve
    Path(args.json).write_text(json.dumps(result, indent=1))
    plot(result, args.plot)
    print(json.dumps({"step_costs": costs, "slos": slos, "summary": result["summary"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
