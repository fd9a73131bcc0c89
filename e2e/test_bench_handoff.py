"""`omni-pd bench handoff --quick` as a user runs it: a table and a JSON with every key, for every
geometry, from a run that checks the handoff moved the bytes unchanged. No timing thresholds."""

import json
import os
import subprocess
import sys

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


def test_quick_run_writes_every_key_for_every_case_and_path(tmp_path):
    json_path = tmp_path / "handoff.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "--log-level",
            "WARNING",
            "bench",
            "handoff",
            "--quick",
            "--json",
            str(json_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(json_path.read_text())
    assert "bench handoff" in report["command"] and report["repeats"] == 2
    results = report["results"]
    assert sorted((r["geometry"], r["path"]) for r in results) == [
        ("Qwen3-Omni-30B-A3B thinker", "shm"),
        ("Qwen3-Omni-30B-A3B thinker", "tcp"),
        ("tiny-qwen3-omni thinker", "shm"),
        ("tiny-qwen3-omni thinker", "tcp"),
    ]
    for r in results:
        assert tuple(r) == KEYS
        assert r["tokens"] == 256 and r["entries"] >= (1 if r["path"] == "tcp" else 0)
        per_token = {
            "tiny-qwen3-omni thinker": 4 * 2 * 2 * 16 * 4,
            "Qwen3-Omni-30B-A3B thinker": 48 * 2 * 4 * 128 * 2,
        }[r["geometry"]]
        assert r["bytes"] == 256 * per_token
        for key in ("memcpy_ms", "wire_ms", "publish_ms", "fetch_ms", "handoff_ms"):
            assert r[key] > 0, (key, r)
        assert r["sender_checksum_ms"] >= 0
        assert abs(r["handoff_over_wire"] - r["handoff_ms"] / r["wire_ms"]) < 1e-9
        assert abs(r["handoff_over_memcpy"] - r["handoff_ms"] / r["memcpy_ms"]) < 1e-9
        assert r["geometry"] in proc.stdout


def test_bad_arguments_are_named(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "omni_pd.entrypoints.cli", "bench", "handoff", "--geometries", "40b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--geometries" in proc.stderr and "tiny" in proc.stderr


def test_push_pull_run_reports_both_modes_from_a_checked_run(tmp_path):
    """`--path push,pull`: each mode moved the bytes unchanged (the bench checks) and the row
    has both modes' times, their overhead over the prefill alone and the share push hides."""
    json_path = tmp_path / "modes.json"
    command = [sys.executable, "-m", "omni_pd.entrypoints.cli", "--log-level", "WARNING", "bench", "handoff"]
    command += ["--path", "push,pull", "--geometries", "tiny", "--tokens", "100", "--repeats", "1"]
    command += ["--chunk-tokens", "40", "--json", str(json_path)]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "MC_LOG_LEVEL": "ERROR"}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(json_path.read_text())
    assert report["prefill_us_per_token"] == 15.0 and report["chunk_tokens"] == 48  # whole blocks
    [row] = report["results"]
    for key in (
        "prefill_ms",
        "push_ms",
        "pull_ms",
        "push_over_ms",
        "pull_over_ms",
        "push_over_pull",
        "hidden",
    ):
        assert isinstance(row[key], float), key
    assert row["tokens"] == 100 and "push_over_pull" in proc.stdout
