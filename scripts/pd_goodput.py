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
5. `--plan`: `omni-pd plan` on step costs profiled at 1 and 2 threads (after the measurement, so
   the profile does not share the cores with it): its prediction and recommendation for the
   same workload and SLOs, and `--compare` of every measured row against it. With
   `--plan-only RESULT.json` it does this step alone on an earlier run's result.
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


def step_costs(
    args: argparse.Namespace,
    scratch: Path,
    core: str = "0",
    stages: list[str] | None = None,
    out: Path | None = None,
) -> dict:
    """Prefill of the median prompt and a decode step at batch 8 (median context), one thread
    pinned to `core` (the stages asked for; the other's figure is None)."""
    prompt, output = (statistics.median(range(a, b + 1)) for a, b in map(uniform, (args.prompt, args.output)))
    prompt, context = int(prompt), int(prompt + output / 2)
    out = out or scratch / "roofline.json"
    subprocess.run(
        ["taskset", "-c", core, OMNI_PD, "bench", "roofline", args.model,
         "--stages", ",".join(stages or ["thinker_prefill", "thinker_decode"]), "--prefill-tokens", str(prompt),
         "--prefill-batches", "1", "--batches", "8", "--contexts", str(context),
         "--repeats", "2", "--json", str(out)],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    prefill = next((r["step_ms"] for r in rows if r["stage"] == "thinker_prefill"), None)
    decode = next((r["step_ms"] for r in rows if r["stage"] == "thinker_decode" and r["batch"] == 8), None)
    return {"median_prompt": prompt, "context": context, "prefill_ms": prefill, "decode_b8_ms": decode}


def slo_pairs(costs: dict) -> dict[str, dict[str, float]]:
    return {
        name: {"itl_ms": itl * costs["decode_b8_ms"], "ttft_ms": ttft * costs["prefill_ms"]}
        for name, (itl, ttft) in PAIRS.items()
    }


def _stage_args(data: dict, **engine_args) -> None:
    for stage in data["stage_args"]:
        stage["engine_args"].update(load_format="auto", kv_pool_blocks=KV_POOL_BLOCKS, **engine_args)


def configs(budgets: list[int], scratch: Path, pd_window_s: float = 600.0) -> list[tuple[str, Path]]:
    """(label, config) of each layout, all on cores 0-1. `pd_window_s`: 1P1D's KV miss window
    (its handoff deadline a minute past it). At the 5 s default a prompt that queues longer than 5 s at the prefill
    core falls back to a local prefill on the decode core (kv_fallback), which stalls every
    decode there for seconds: a deployment expecting such queues sets the window past them."""
    made: list[tuple[str, dict]] = []
    pd = yaml.safe_load(THINKER_PD.read_text())
    _stage_args(pd)
    for stage, cpus in zip(pd["stage_args"], ("0", "1")):
        stage.setdefault("runtime", {})["cpus"] = cpus
        extra = stage["engine_args"]["kv_transfer_config"].setdefault("kv_connector_extra_config", {})
        extra.update(kv_miss_window_s=pd_window_s, kv_handoff_deadline_s=pd_window_s + 60)  # must be above
    made.append(("1P1D", pd))
    for budget in budgets:
        colocated = yaml.safe_load(THINKER.read_text())
        _stage_args(colocated, max_num_batched_tokens=budget)
        colocated["stage_args"][0]["runtime"].update(num_replicas=2, cpus=["0", "1"])
        made.append((f"colocated-2x_b{budget}", colocated))
    single = yaml.safe_load(THINKER.read_text())
    _stage_args(single, max_num_batched_tokens=budgets[len(budgets) // 2])  # _middle
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


PLAN_ROOFLINE = [
    "--stages", "thinker_prefill,thinker_decode", "--prefill-tokens", "64,256,1024",
    "--prefill-batches", "1,2", "--batches", "1,4,8,16", "--contexts", "256,1024", "--repeats", "2",
]  # fmt: skip


def _roofline_ms(args: argparse.Namespace, core: str, stages: list[str], out: Path) -> dict[str, float]:
    """Prefill of the median prompt and decode at batch 8 (median context), one thread on `core`."""
    costs = step_costs(args, out.parent, core=core, stages=stages, out=out)
    return {"prefill": costs["prefill_ms"], "decode": costs["decode_b8_ms"]}


def contention(args: argparse.Namespace, scratch: Path) -> dict:
    """How much slower each pass runs on core 1 while core 0 runs the other role's pass (P/D's
    neighbours; they share the memory bus): each pass timed quiet, then beside a neighbour."""
    quiet = _roofline_ms(args, "1", ["thinker_prefill", "thinker_decode"], scratch / "quiet.json")
    busy = {}
    for role, neighbour in (("decode", "thinker_prefill"), ("prefill", "thinker_decode")):
        load = subprocess.Popen(
            ["taskset", "-c", "0", OMNI_PD, "bench", "roofline", args.model, "--stages", neighbour,
             "--prefill-tokens", "1024", "--prefill-batches", "1", "--batches", "8", "--contexts", "656",
             "--repeats", "400"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert load.stdout is not None
        for line in load.stdout:  # its bandwidth probe done: it is computing from here on
            if line.startswith("host:"):
                break
        try:
            busy[role] = _roofline_ms(args, "1", [f"thinker_{role}"], scratch / f"busy-{role}.json")[role]
        finally:
            load.kill()
            load.wait()
    return {
        "quiet_ms": quiet,
        "beside_neighbour_ms": busy,
        "slowdown": {role: max(busy[role] / quiet[role], 1.0) for role in busy},
    }


def _plan_label(label: str, budgets: dict[str, int]) -> str:
    """A driver label as `omni-pd plan --compare` reads it (the chunk budget as an @key=value)."""
    if label.startswith("colocated-2x_b"):
        return f"colocated-2x@max_num_batched_tokens={label.removeprefix('colocated-2x_b')}"
    if label == "colocated-1x":
        return f"colocated-1x@max_num_batched_tokens={budgets['colocated-1x']}"
    return label


def plan(result: dict, args: argparse.Namespace, scratch: Path) -> dict:
    """`omni-pd plan` on this host's step costs (1 and 2 threads): its prediction for the
    experiment's workload and SLOs, and every measured row against it."""
    profiles = []
    for cpus, threads in (("0", "1"), ("0,1", "2")):
        out = scratch / f"roofline-t{threads}.json"
        subprocess.run(
            [
                "taskset",
                "-c",
                cpus,
                OMNI_PD,
                "bench",
                "roofline",
                args.model,
                *PLAN_ROOFLINE,
                "--json",
                str(out),
            ],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": threads},
        )
        profiles.append(str(out))
    slos = result["slos"]
    serve = result["serve"]
    budgets = {"colocated-1x": _middle(args.budgets)}
    compare = []
    for pair, slo in slos.items():
        copy = json.loads(json.dumps(serve))
        copy.update(slo_ttft_ms=slo["ttft_ms"], slo_itl_ms=slo["itl_ms"])
        for row in copy["open_loop"]:
            row["goodput_req_per_s"] = goodput(row, slo)
            row["config"] = _plan_label(row["config"], budgets)
        path = scratch / f"{pair}.json"
        path.write_text(json.dumps(copy))
        compare.append(str(path))
    common = ["--profile", ",".join(profiles), "--cpus", "2", "--kv-blocks", str(KV_POOL_BLOCKS)]
    compared = scratch / "compare.json"
    subprocess.run(
        [OMNI_PD, "plan", *common, "--compare", ",".join(compare), "--json", str(compared)], check=True
    )
    shared = contention(args, scratch)
    corun = f"{shared['slowdown']['prefill']:.3f},{shared['slowdown']['decode']:.3f}"
    print(f"contention {shared}", file=sys.stderr)
    compared_corun = scratch / "compare-corun.json"
    subprocess.run(
        [OMNI_PD, "plan", *common, "--corun-slowdown", corun, "--compare", ",".join(compare),
         "--json", str(compared_corun)],
        check=True,
    )  # fmt: skip
    predicted = scratch / "plan.json"
    subprocess.run(
        [OMNI_PD, "plan", *common, "--prompt-tokens", args.prompt, "--output-tokens", args.output,
         "--request-rate", args.rates, "--num-requests", str(args.requests), "--seed", str(args.seed),
         "--slo-ttft-ms", ",".join(f"{slos[p]['ttft_ms']:.0f}" for p in PAIRS),
         "--slo-itl-ms", ",".join(f"{slos[p]['itl_ms']:.0f}" for p in PAIRS),
         "--layouts", "1P1D,colocated-2x,colocated-1x", "--chunk-budgets", args.budgets,
         "--json", str(predicted)],
        check=True,
    )  # fmt: skip
    return {
        "profiles": {Path(p).stem: json.loads(Path(p).read_text()) for p in profiles},
        "compare": json.loads(compared.read_text()),
        "contention": shared,
        "compare_corun": json.loads(compared_corun.read_text()),
        "prediction": json.loads(predicted.read_text()),
    }


def _middle(budgets: str) -> int:
    """colocated-1x's chunk budget: the middle one of the sweep (`configs`)."""
    values = [int(b) for b in budgets.split(",")]
    return values[len(values) // 2]


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
    parser.add_argument(
        "--pd-window",
        type=float,
        default=600.0,
        help="1P1D's kv_miss_window_s (kv_handoff_deadline_s 60 s more)",
    )
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot", required=True)
    parser.add_argument("--plan", action="store_true", help="then predict it with omni-pd plan (step 5)")
    parser.add_argument("--plan-only", metavar="RESULT", help="step 5 alone, on an earlier run's --json")
    args = parser.parse_args()
    if args.plan_only:
        result = json.loads(Path(args.plan_only).read_text())
        with tempfile.TemporaryDirectory(prefix="pd-goodput-plan-") as tmp:
            result["plan"] = plan(result, args, Path(tmp))
        Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix="pd-goodput-") as tmp:
        scratch = Path(tmp)
        costs = step_costs(args, scratch)
        slos = slo_pairs(costs)
        print(f"step costs {costs}\nSLO pairs {slos}", file=sys.stderr)
        targets = configs([int(b) for b in args.budgets.split(",")], scratch, args.pd_window)
        serve = bench(args, targets, slos, scratch)
        for label, path in targets:  # the JSON keeps each layout's config itself
            serve["configs"][label] = str(path)
            serve.setdefault("config_texts", {})[label] = path.read_text()
        result = {"command": " ".join(sys.argv), "step_costs": costs, "slos": slos, **analyse(serve, slos)}
        result["serve"] = serve
        if args.plan:
            result["plan"] = plan(result, args, scratch)
    Path(args.json).write_text(json.dumps(result, indent=1))
    plot(result, args.plot)
    print(json.dumps({"step_costs": costs, "slos": slos, "summary": result["summary"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
