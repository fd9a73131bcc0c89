"""`omni-pd plan` end to end on the recorded tiny-model profiles (tests/data/plan_roofline_tiny_t*.json,
written by `bench roofline` on `make-tiny-model`'s checkpoint): it prints a table and a
recommendation per SLO pair and writes JSON; `--compare` reads a bench result and reports each
row's error and whether the winner agrees; every bad input is refused in one line naming its
flag; `--profile-model` turns what the roofline's bench measures into a plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_pd.entrypoints.cli import main

DATA = Path(__file__).parent / "data"
T1, T2 = str(DATA / "plan_roofline_tiny_t1.json"), str(DATA / "plan_roofline_tiny_t2.json")
BASE = ["plan", "--profile", f"{T1},{T2}", "--cpus", "2", "--num-requests", "16"]


def test_the_plan_prints_a_recommendation_per_slo_pair_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main([*BASE, "--request-rate", "5,20", "--chunk-budgets", "256,1024", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "recommended under tight:" in printed and "recommended under loose:" in printed
    assert "colocated-2x by max_num_batched_tokens" in printed
    plan = json.loads(out.read_text())
    # 1P1D at the default budget, colocated-2x and -1x at two budgets each; 2 rates; 2 SLO pairs.
    assert len(plan["predictions"]) == (1 + 2 + 2) * 2 * 2
    assert set(plan["recommended"]) == {"tight", "loose"}
    assert {p["threads_per_worker"] for p in plan["predictions"] if p["layout"] == "colocated-1x"} == {2}
    tight = plan["recommended"]["tight"]
    best = max(p["goodput_req_per_s"] for p in plan["predictions"] if p["slo"] == "tight")
    assert tight["goodput_req_per_s"] == pytest.approx(best)
    assert plan["slos"][0]["itl_ms"] == pytest.approx(1.25 / 3 * plan["slos"][1]["itl_ms"])


def test_a_pick_closer_than_the_resolution_is_called_too_close(tmp_path, capsys):
    """The same plan read at two resolutions: one above the pick's predicted margin over the
    next layout says "too close to call" and writes decisive false; one below it (the control)
    names the pick plainly."""
    argv = [*BASE, "--request-rate", "5,20", "--slo-pairs", "tight"]
    out = tmp_path / "plan.json"
    assert main([*argv, "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["recommended"]["tight"]
    margin = rec["margin"]
    assert rec["runner_up"] is not None and 0 <= margin < 1
    assert margin == pytest.approx(1 - rec["runner_up_goodput_req_per_s"] / rec["goodput_req_per_s"])
    capsys.readouterr()
    for resolution, decisive in ((min(0.99, margin + 0.01), False), (max(0.0, margin - 0.01), True)):
        assert main([*argv, "--resolution", str(resolution), "--json", str(out)]) == 0
        line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("recommended")][0]
        assert ("too close to call" in line) == (not decisive), line
        assert json.loads(out.read_text())["recommended"]["tight"]["decisive"] is decisive


def test_absolute_slos_are_used_as_given(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            *BASE,
            "--layouts",
            "1P1D",
            "--request-rate",
            "5",
            "--slo-ttft-ms",
            "100,1000",
            "--slo-itl-ms",
            "5,50",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    slos = json.loads(out.read_text())["slos"]
    assert [(s["ttft_ms"], s["itl_ms"]) for s in slos] == [(100.0, 5.0), (1000.0, 50.0)]


BAD = [
    (["--request-rate", "5", "--slo-ttft-ms", "0", "--slo-itl-ms", "10"], "--slo-ttft-ms"),
    (["--request-rate", "5", "--slo-ttft-ms", "100", "--slo-itl-ms", "-5"], "--slo-itl-ms"),
    (["--request-rate", "5", "--slo-ttft-ms", "100"], "--slo-itl-ms"),
    (["--request-rate", "5", "--slo-pairs", "tight,wide"], "--slo-pairs"),
    (["--request-rate", "5", "--prompt-tokens", "uniform:10"], "--prompt-tokens"),
    (["--request-rate", "5", "--output-tokens", "uniform:9:3"], "--output-tokens"),
    (["--request-rate", "5", "--chunk-budgets", "8,256"], "--chunk-budgets"),
    (["--request-rate", "5", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens"),
    (["--request-rate", "5", "--layouts", "1P1D,3X"], "--layouts"),
    (["--request-rate", "5", "--layouts", "2P2D"], "--cpus"),
    (["--request-rate", "5", "--layouts", "1P1D", "--cpus", "3"], "--cpus"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "5", "--kv-blocks", "10"], "--kv-blocks"),
    (["--request-rate", "5", "--num-requests", "0"], "--num-requests"),
    (["--request-rate", "5", "--corun-slowdown", "0.5,1"], "--corun-slowdown"),
    (["--request-rate", "5", "--corun-slowdown", "2"], "--corun-slowdown"),
    (["--request-rate", "5", "--resolution", "1.5"], "--resolution"),
    (["--request-rate", "5", "--resolution", "-0.1"], "--resolution"),
]


@pytest.mark.parametrize(
    ("extra", "flag"), BAD, ids=[f"{flag}:{' '.join(extra[2:]) or extra[1]}" for extra, flag in BAD]
)
def test_bad_input_is_refused_in_one_line_naming_its_flag(extra, flag, capsys):
    rc = main([*BASE, *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and "\n" not in err
    assert flag in err


def test_a_missing_thread_count_is_refused_naming_what_to_measure(capsys):
    rc = main(["plan", "--profile", T1, "--cpus", "2", "--request-rate", "5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "2 threads" in err and "--thread-speedup" in err and "\n" not in err
    assert (
        main(
            [
                "plan",
                "--profile",
                T1,
                "--cpus",
                "2",
                "--request-rate",
                "5",
                "--num-requests",
                "8",
                "--thread-speedup",
                "1.5",
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    ("profile", "needle"),
    [(None, "--profile"), ("/nonexistent/roofline.json", "--profile /nonexistent")],
)
def test_a_missing_profile_is_refused(profile, needle, capsys):
    argv = ["plan", "--request-rate", "5"] + (["--profile", profile] if profile else [])
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def _bench_json(path: Path, plan: dict, labels: dict[str, str], goodput) -> None:
    """A bench serve --json result (hand-made for the test) whose open-loop rows measured
    `goodput(prediction)` for each planned config named in `labels` (plan config -> bench label),
    plus one row whose label names no layout."""
    rows = [
        {
            "config": labels[p["config"]],
            "offered": str(p["request_rate"]),
            "request_rate": p["request_rate"],
            "num_requests": 16,
            "goodput_req_per_s": goodput(p),
        }
        for p in plan["predictions"]
        if p["slo"] == "slo1" and p["config"] in labels
    ]
    rows.append(
        {"config": "qwen3_omni_tiny", "request_rate": 5.0, "num_requests": 16, "goodput_req_per_s": 1.0}
    )
    slo = plan["slos"][0]
    body = {
        "seed": 0,
        "slo_ttft_ms": slo["ttft_ms"],
        "slo_itl_ms": slo["itl_ms"],
        "workload": {"prompt_tokens": "uniform:256:1024", "output_tokens": "uniform:16:64"},
        "results": [],
        "open_loop": rows,
    }
    path.write_text(json.dumps(body))


def test_compare_reports_each_rows_error_and_whether_the_winner_agrees(tmp_path, capsys):
    planned = tmp_path / "plan.json"
    argv = [*BASE, "--layouts", "1P1D,colocated-2x", "--request-rate", "5,20", "--chunk-budgets", "512,1024"]
    assert main([*argv, "--slo-ttft-ms", "60", "--slo-itl-ms", "4", "--json", str(planned)]) == 0
    plan = json.loads(planned.read_text())
    labels = {
        "1P1D": "1P1D",
        "colocated-2x@max_num_batched_tokens=512": "Colocated_2x@max_num_batched_tokens=512",
    }
    bench = tmp_path / "bench.json"
    _bench_json(bench, plan, labels, lambda p: p["goodput_req_per_s"])
    capsys.readouterr()
    out = tmp_path / "compare.json"
    assert main([*BASE, "--compare", str(bench), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "agrees" in printed
        and "DISAGREES" not in printed
        and "skipped" in printed
        and "qwen3_omni_tiny" in printed
    )
    compared = json.loads(out.read_text())
    assert len(compared["rows"]) == 4 and all(abs(r["rel_err"]) < 1e-9 for r in compared["rows"])
    assert len(compared["best"]) == 2 and all(abs(b["rel_err"]) < 1e-9 for b in compared["best"])
    # Each side picks its own best rate: measured goodput that peaks at the other rate is
    # compared at that rate, and its error is the ratio of the two peaks.
    peak = {
        label: max(
            (p for p in plan["predictions"] if p["config"] == label), key=lambda p: p["goodput_req_per_s"]
        )
        for label in labels
    }
    _bench_json(
        bench, plan, labels,
        lambda p: 2 * peak[p["config"]]["goodput_req_per_s"] if p is not peak[p["config"]] else 0.5 * p["goodput_req_per_s"],
    )  # fmt: skip
    assert main([*BASE, "--compare", str(bench), "--json", str(out)]) == 0
    for b in json.loads(out.read_text())["best"]:
        assert b["measured_rate"] != b["predicted_rate"] and abs(b["rel_err"] + 0.5) < 1e-9, b
    capsys.readouterr()
    # Negative control: measured figures that crown the other layout are seen.
    [verdict] = compared["winners"].values()
    _bench_json(bench, plan, labels, lambda p: 100.0 if labels[p["config"]] != verdict["measured"] else 1.0)
    assert main([*BASE, "--compare", str(bench), "--compare-map", "qwen3_omni_tiny=colocated-1x"]) == 0
    printed = capsys.readouterr().out
    assert "DISAGREES" in printed and "skipped" not in printed


def test_profile_model_plans_from_what_the_roofline_bench_measures(tmp_path, monkeypatch, capsys):
    """The wiring of --profile-model, with the roofline's bench replaced by rows from the
    recorded profile (the real one: test_profile_model_on_the_tiny_checkpoint)."""
    from omni_pd.bench.roofline import Row
    from omni_pd.plan import profile_run
    from omni_pd.plan.profile import read_profile

    recorded = {t: read_profile(DATA / f"plan_roofline_tiny_t{t}.json") for t in (1, 2)}
    asked = []

    class Stub:
        bandwidth = 1e10

        def __init__(self):
            import torch

            self.threads = torch.get_num_threads()
            self.rows = []

        def thinker(self, prefill, decode):
            asked.append((self.threads, prefill, decode))
            for r in recorded[self.threads].rows:
                self.rows.append(Row(r.stage, r.batch, r.tokens, r.context, 4, r.step_ms, 0, 0, 1.0, 1.0))

    monkeypatch.setattr(profile_run, "_quick_bench", lambda *a: Stub())
    (tmp_path / "ckpt").mkdir()
    saved = tmp_path / "profiles"
    rc = main(
        [
            "plan",
            "--profile-model",
            str(tmp_path / "ckpt"),
            "--save-profile",
            str(saved),
            "--cpus",
            "2",
            "--request-rate",
            "5",
            "--num-requests",
            "8",
        ]
    )
    assert rc == 0 and "recommended under tight" in capsys.readouterr().out
    assert sorted(t for t, _, _ in asked) == [1, 2]
    assert asked[0][1] == list(profile_run.PREFILL_ROWS)
    again = read_profile(saved / "roofline-t2.json")
    assert again.threads == 2 and again.rows == recorded[2].rows


@pytest.mark.slow
def test_profile_model_on_the_tiny_checkpoint(tmp_path):
    """The real short profile on the embedded tiny model (about 10 s: loading the model)."""
    from omni_pd.models.qwen3_omni.factory import save_tiny_model
    from omni_pd.plan.costs import fit_costs
    from omni_pd.plan.profile_run import profile_model

    checkpoint = save_tiny_model(tmp_path / "tiny", seed=0)
    [profile] = profile_model(str(checkpoint), [1])
    assert profile.threads == 1 and len(profile.stage("thinker_prefill")) == 4
    costs = fit_costs(profile)
    assert costs.prefill_ms([(1024, 0)]) > costs.prefill_ms([(64, 0)]) > 0
