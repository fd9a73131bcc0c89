"""`omni-pd bench serve --quick` as a user runs it: it starts a server per default config, drives it
with the openai client and writes a complete JSON and a PNG. No timing thresholds: only that every
number is there, sane and consistent."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CONFIGS = ("qwen3_omni_tiny", "qwen3_omni_tiny_pd")
LEVELS = (1, 4)  # what --quick runs
METRICS = (
    "req_per_s",
    "output_tok_per_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "ttfa_ms_p50",
    "ttfa_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "e2e_ms_p50",
    "e2e_ms_p99",
    "errors",
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "--log-level",
            "WARNING",
            "bench",
            "serve",
            "--quick",
            "--json",
            str(json_path),
            "--plot",
            str(png_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    return proc, json_path, png_path


def test_quick_run_exits_cleanly_and_prints_a_row_per_config_and_level(quick_run):
    proc, _, _ = quick_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [
        line.split() for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in CONFIGS
    ]
    assert sorted((r[0], int(r[1])) for r in rows) == sorted((c, n) for c in CONFIGS for n in LEVELS)


def test_json_has_every_key_for_every_config_and_level(quick_run):
    proc, json_path, _ = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(json_path.read_text())
    assert report["max_tokens"] == 24 and report["concurrency"] == list(LEVELS)
    assert report["num_requests"] == [max(4, c) for c in LEVELS]  # --quick: 4 a level
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["python"]
    assert "bench serve" in report["command"] and report["date"]
    results = report["results"]
    assert sorted((r["config"], r["concurrency"]) for r in results) == sorted(
        (c, n) for c in CONFIGS for n in LEVELS
    )
    for r in results:
        where = f"{r['config']} c={r['concurrency']}"
        assert {"config", "concurrency", "num_requests", *METRICS, "req_per_s_vs_c1", "e2e_p50_vs_c1"} <= set(
            r
        ), where
        assert r["num_requests"] >= r["concurrency"], where
        assert r["errors"] == 0, where
        assert r["req_per_s"] > 0 and r["output_tok_per_s"] > 0, where
        for name in ("ttft", "ttfa", "itl", "e2e"):
            p50, p99 = r[f"{name}_ms_p50"], r[f"{name}_ms_p99"]
            if name == "ttfa":
                assert p50 is not None and p99 is not None, where
            if p50 is None:
                assert p99 is None, where
                continue
            assert 0 <= p50 <= p99, (where, name, p50, p99)
        assert r["ttfa_ms_p50"] <= r["e2e_ms_p99"], where
        assert r["req_per_s_vs_c1"] > 0, where
        if r["config"] != CONFIGS[0]:
            assert r[f"req_per_s_vs_{CONFIGS[0]}"] > 0, where
        # The P/D server's handoffs, read from its /metrics around the level; none colocated.
        if r["config"] == "qwen3_omni_tiny_pd":
            assert r["kv_handoff_ms_mean"] > 0 and isinstance(r["pd_ttft_overhead_ms"], float), where
        else:
            assert r["kv_handoff_ms_mean"] is None and "pd_ttft_overhead_ms" not in r, where
    for config in CONFIGS:
        lowest = min((r for r in results if r["config"] == config), key=lambda r: r["concurrency"])
        assert lowest["req_per_s_vs_c1"] == pytest.approx(1.0)
        assert lowest["e2e_p50_vs_c1"] == pytest.approx(1.0)
    assert "NaN" not in json_path.read_text()


def test_plot_is_a_png(quick_run):
    proc, _, png_path = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert png_path.is_file() and png_path.read_bytes()[:8] == PNG_SIGNATURE


XPYD_CPUS = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0))[:2])


@pytest.fixture(scope="module")
def xpyd_run(tmp_path_factory):
    """The fair-baseline comparison in its smallest form: 1P1D beside colocated with two thinker
    replicas, each thinker worker pinned to one of two CPUs, a closed-loop level, then Poisson
    arrivals at half the measured capacity."""
    json_path = tmp_path_factory.mktemp("bench") / "xpyd.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "--log-level",
            "WARNING",
            "bench",
            "serve",
            "--xpyd",
            "1P1D",
            "--xpyd-cpus",
            XPYD_CPUS,
            "--concurrency",
            "2",
            "--num-requests",
            "4",
            "--request-rate",
            "50%",
            "--open-loop-requests",
            "4",
            "--slo-ttft-ms",
            "60000",
            "--slo-ttfa-ms",
            "60000",
            "--json",
            str(json_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    return proc, json_path


def test_xpyd_runs_each_layout_beside_its_colocated_replicas_with_goodput(xpyd_run):
    proc, json_path = xpyd_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(json_path.read_text())
    assert report["baselines"] == {"1P1D": "colocated-2x"}
    first, second = XPYD_CPUS.split(",")  # each thinker worker one of the two CPUs
    assert report["target_cpus"] == {
        "colocated-2x": {"thinker": [first, second]},
        "1P1D": {"prefill": [first], "decode": [second]},
    }
    closed = {r["config"]: r for r in report["results"]}
    assert set(closed) == {"colocated-2x", "1P1D"}
    assert closed["1P1D"]["req_per_s_vs_baseline"] > 0 and closed["1P1D"]["kv_handoff_ms_mean"] > 0
    opened = report["open_loop"]
    assert sorted(r["config"] for r in opened) == ["1P1D", "colocated-2x"]
    for row in opened:
        # Half of that config's capacity, measured by its closed-loop level in this run.
        assert row["offered"] == "50%"
        assert row["request_rate"] == pytest.approx(0.5 * closed[row["config"]]["req_per_s"])
        assert row["errors"] == 0 and row["completed"] == 4
        # Every request is within SLOs this loose: goodput is the completed requests' rate.
        assert row["slo_attainment"] == 1.0
        assert row["goodput_req_per_s"] == pytest.approx(row["req_per_s"])
        assert 0 <= row["ttfa_ms_p50"] <= row["ttfa_ms_p99"]
    assert "goodput" in proc.stdout and "offered" in proc.stdout


def test_realtime_mode_runs_each_level_through_both_endpoints(tmp_path):
    """`--realtime`: the same prompts through /v1/chat/completions and /v1/realtime, each
    realtime row with its TTFA against the chat row's."""
    json_path = tmp_path / "realtime.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "--log-level",
            "WARNING",
            "bench",
            "serve",
            "--configs",
            "stage_configs/ci/qwen3_omni_tiny.yaml",
            "--realtime",
            "--ignore-eos",
            "--concurrency",
            "2",
            "--num-requests",
            "4",
            "--json",
            str(json_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = {r["endpoint"]: r for r in json.loads(json_path.read_text())["results"]}
    assert set(rows) == {"chat", "realtime"} and json.loads(json_path.read_text())["realtime"]
    chat, realtime = rows["chat"], rows["realtime"]
    assert realtime["config"] == "qwen3_omni_tiny realtime" and realtime["chat_config"] == chat["config"]
    for row in (chat, realtime):
        assert row["errors"] == 0 and row["num_requests"] == 4 and row["no_speech"] == 0
        assert 0 < row["ttft_ms_p50"] <= row["ttfa_ms_p50"] <= row["e2e_ms_p50"]
        assert row["output_tok_per_s"] > 0
    assert realtime["ttfa_vs_chat"] == pytest.approx(realtime["ttfa_ms_p50"] / chat["ttfa_ms_p50"], rel=1e-2)
    assert "ttfa vs chat" in proc.stdout
