"""`omni-pd bench serve --text-only` with a seeded mixed-length workload, as a user runs it: the
thinker-only configs (colocated and P/D) are started by default, every request asks for text
alone, and each answer is exactly as long as the workload drew (--ignore-eos), its prompt as many
tokens as drawn plus the chat template's. About 40 s on 2 cores."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CONFIGS = ("qwen3_omni_tiny_thinker", "qwen3_omni_tiny_thinker_pd")
LEVELS = (1, 4)  # what --quick runs
PROMPT, OUTPUT = (8, 32), (2, 6)


@pytest.fixture(scope="module")
def text_only_run(tmp_path_factory):
    json_path = tmp_path_factory.mktemp("bench") / "text_only.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "--log-level",
            "WARNING",
            "bench",
            "serve",
            "--text-only",
            "--quick",
            "--prompt-tokens",
            "uniform:%d:%d" % PROMPT,
            "--output-tokens",
            "uniform:%d:%d" % OUTPUT,
            "--ignore-eos",
            "--json",
            str(json_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(json_path.read_text())


def _template_tokens() -> int:
    """The chat template's tokens around one user message (the server counts them in usage)."""
    from omni_pd.bench.sized_prompts import load_tokenizer

    tokenizer = load_tokenizer("tiny-qwen3-omni")
    empty = [{"role": "user", "content": ""}]
    return len(
        tokenizer.apply_chat_template(empty, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def test_the_thinker_only_configs_ran_every_level_without_audio(text_only_run):
    report = text_only_run
    assert report["text_only"] is True and report["max_tokens"] is None
    results = report["results"]
    assert sorted((r["config"], r["concurrency"]) for r in results) == sorted(
        (c, n) for c in CONFIGS for n in LEVELS
    )
    for row in results:
        where = f"{row['config']} c={row['concurrency']}"
        assert row["errors"] == 0 and row["completed"] == row["num_requests"] == 4, where
        assert row["ttfa_ms_p50"] is None and row["no_speech"] == 0, where  # no audio asked for
        assert row["ttft_ms_p50"] > 0 and row["req_per_s"] > 0, where
        # the P/D thinker handed its KV over; the colocated one has nothing to hand over
        assert (row["kv_handoff_ms_mean"] is not None) == row["config"].endswith("_pd"), where


def test_each_request_has_the_drawn_lengths_the_same_in_every_config_and_level(text_only_run):
    template = _template_tokens()
    sequences = set()
    for row in text_only_run["results"]:
        where = f"{row['config']} c={row['concurrency']}"
        requests = row["requests"]
        assert [r["index"] for r in requests] == list(range(row["num_requests"])), where
        for r in requests:
            assert r["ok"], (where, r)
            assert PROMPT[0] <= r["prompt_tokens_drawn"] <= PROMPT[1], (where, r)
            assert OUTPUT[0] <= r["output_tokens_drawn"] <= OUTPUT[1], (where, r)
            assert r["output_tokens"] == r["output_tokens_drawn"], (where, r)
            assert r["prompt_tokens"] == r["prompt_tokens_drawn"] + template, (where, r)
        sequences.add(tuple((r["prompt_tokens_drawn"], r["output_tokens_drawn"]) for r in requests))
    assert len(sequences) == 1  # request i the same everywhere
    (pairs,) = sequences
    assert len(set(pairs)) > 1  # mixed lengths, not one repeated


def test_the_workload_and_its_lengths_are_in_the_json(text_only_run):
    workload = text_only_run["workload"]
    assert workload["prompt_tokens"] == "uniform:%d:%d" % PROMPT
    assert workload["output_tokens"] == "uniform:%d:%d" % OUTPUT
    assert workload["seed"] == 0 and workload["requests"] == 4
    requests = text_only_run["results"][0]["requests"]
    for key in ("prompt_tokens_drawn", "output_tokens_drawn"):
        drawn = [r[key] for r in requests]
        summary = workload[key]
        assert (summary["min"], summary["max"]) == (min(drawn), max(drawn)), key
        assert summary["mean"] == pytest.approx(sum(drawn) / len(drawn)), key
