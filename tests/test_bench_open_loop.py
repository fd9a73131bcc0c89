"""The open-loop and xPyD parts of `omni-pd bench serve`: arrivals, goodput, EOS-first answers
counted apart, the layouts and their colocated baselines, the rate flag."""

from __future__ import annotations

import statistics

import pytest

from omni_pd.bench.load import poisson_arrivals
from omni_pd.bench.serve import add_baseline_ratios
from omni_pd.bench.serve_configs import xpyd_targets
from omni_pd.bench.serve_target import parse_rates
from omni_pd.bench.stats import RequestRecord, mean_tpot_s, meets_slo, summarize_level
from omni_pd.config import load_pipeline_config


def test_poisson_arrivals_are_reproducible_and_have_the_rate():
    times = poisson_arrivals(rate=20.0, num_requests=4000, seed=7)
    assert times == poisson_arrivals(20.0, 4000, seed=7) and times[0] == 0.0
    assert times != poisson_arrivals(20.0, 4000, seed=8)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean (a fixed pace would have none).
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)


def _ok(ttft, ttfa, no_speech=False):
    return RequestRecord(ok=True, ttft_s=ttft, ttfa_s=ttfa, e2e_s=1.0, no_speech=no_speech, output_tokens=1)


def test_goodput_counts_requests_within_both_slos_and_no_speech_apart():
    records = [
        _ok(0.1, 0.2),
        _ok(0.1, 0.9),
        _ok(0.6, 0.2),
        _ok(0.05, None, no_speech=True),
        RequestRecord(ok=False, error="boom"),
        RequestRecord(ok=False, rejected=True, error="RateLimitError: 429"),
    ]
    row = summarize_level(records, wall_s=2.0, slo_ttft_ms=500, slo_ttfa_ms=500)
    # Within both: the first, and the one without speech (it has no TTFA to miss).
    assert row["goodput_req_per_s"] == pytest.approx(1.0) and row["slo_attainment"] == pytest.approx(2 / 6)
    assert row["no_speech"] == 1 and row["errors"] == 2 and row["rejected"] == 1
    assert row["completed"] == 4
    # TTFA percentiles leave the answer without speech out.
    assert row["ttfa_ms_p50"] == pytest.approx(200.0)
    assert "goodput_req_per_s" not in summarize_level(records, wall_s=2.0)  # no SLO, no goodput


def _timed(ttft: float, e2e: float, tokens: int) -> RequestRecord:
    return RequestRecord(ok=True, ttft_s=ttft, ttfa_s=ttft, e2e_s=e2e, output_tokens=tokens)


def test_the_itl_slo_is_judged_per_request_on_its_mean_time_per_output_token():
    """DistServe's goodput: a request counts only if every SLO holds, the inter-token one on its
    own mean time per output token after the first, (e2e - ttft) / (tokens - 1)."""
    records = [
        _timed(0.10, 0.10 + 9 * 0.020, 10),  # 20 ms per token: within 25
        _timed(0.10, 0.10 + 9 * 0.030, 10),  # 30 ms per token: over 25
        _timed(0.90, 0.90 + 9 * 0.010, 10),  # fast tokens, but TTFT over its 500 ms SLO
        _timed(0.10, 0.10, 1),  # one token: no gap to miss
    ]
    assert mean_tpot_s(records[0]) == pytest.approx(0.020) and mean_tpot_s(records[3]) is None
    row = summarize_level(records, wall_s=1.0, slo_ttft_ms=500, slo_itl_ms=25)
    assert row["goodput_req_per_s"] == pytest.approx(2.0) and row["slo_attainment"] == pytest.approx(0.5)
    assert row["tpot_ms_p50"] == pytest.approx(20.0)
    # Negative control: without the ITL SLO the 30 ms request counts; with only it, the slow
    # first token does.
    assert summarize_level(records, wall_s=1.0, slo_ttft_ms=500)["goodput_req_per_s"] == pytest.approx(3.0)
    assert summarize_level(records, wall_s=1.0, slo_itl_ms=25)["goodput_req_per_s"] == pytest.approx(3.0)
    assert not meets_slo(records[1], None, None, slo_itl_ms=25) and meets_slo(records[1], None, None, 35)


def test_request_rates_take_numbers_and_shares_of_capacity():
    assert parse_rates("8, 50%") == [("8", 8.0, False), ("50%", 0.5, True)]
    assert parse_rates(None) == []
    for bad in ("0", "-1", "fast", "0%"):
        with pytest.raises(SystemExit, match="--request-rate"):
            parse_rates(bad)


def test_xpyd_layouts_come_with_colocated_baselines_of_as_many_thinker_workers(tmp_path):
    made = xpyd_targets(
        "1P1D,1P2D,2p1d",
        "stage_configs/ci/qwen3_omni_tiny_pd.yaml",
        "stage_configs/ci/qwen3_omni_tiny.yaml",
        tmp_path,
        cpus=tuple(range(6)),  # shared evenly by 2 and by 3 workers
    )
    assert [(t.label, t.baseline) for t in made] == [
        ("colocated-2x", None),
        ("1P1D", "colocated-2x"),
        ("colocated-3x", None),
        ("1P2D", "colocated-3x"),
        ("2P1D", "colocated-3x"),
    ]
    for label, path, _, _ in made:
        stages = load_pipeline_config(path).stages
        replicas = {
            s.model_stage
            + ("/p" if s.is_prefill_only else "/d" if s.is_decode_only else ""): s.runtime.num_replicas
            for s in stages
        }
        if label.startswith("colocated"):
            assert replicas["thinker"] == int(label.split("-")[1][:-1])
        else:
            assert (replicas["thinker/p"], replicas["thinker/d"]) == (int(label[0]), int(label[2]))
        assert replicas["talker"] == replicas["code2wav"] == 1  # only the thinker is scaled
    with pytest.raises(SystemExit, match="1P1D, 2P2D or colocated-1x"):
        xpyd_targets(
            "0P1D",
            "stage_configs/ci/qwen3_omni_tiny_pd.yaml",
            "stage_configs/ci/qwen3_omni_tiny.yaml",
            tmp_path,
            cpus=(0, 1),
        )


def test_baseline_ratios_pair_rows_of_the_same_level():
    rows = [
        {"config": "colocated-2x", "concurrency": 4, "req_per_s": 10.0, "goodput_req_per_s": 8.0},
        {"config": "1P1D", "concurrency": 4, "req_per_s": 5.0, "goodput_req_per_s": 6.0},
        {"config": "1P1D", "concurrency": 8, "req_per_s": 5.0},
    ]
    add_baseline_ratios(rows, {"1P1D": "colocated-2x"}, "concurrency")
    assert rows[1]["req_per_s_vs_baseline"] == 0.5 and rows[1]["goodput_vs_baseline"] == 0.75
    assert "baseline" not in rows[0] and "baseline" not in rows[2]  # no baseline row at c=8


def test_multi_turn_rows_per_turn_and_against_caching_off(tmp_path):
    from omni_pd.bench.multi_turn import (
        add_uncached_ratios,
        conversation_turn,
        summarize_turns,
        uncached_twins,
    )
    from omni_pd.bench.serve_configs import resolve_config

    def record(ttft, cached):
        return RequestRecord(
            ok=True, ttft_s=ttft, ttfa_s=2 * ttft, e2e_s=1.0, output_tokens=3, text="hi", cached_tokens=cached
        )

    on = summarize_turns("tiny", [[(record(0.1, 0), 100)], [(record(0.02, 96), 180)]])
    off = summarize_turns("tiny@prefix_caching=false", [[(record(0.1, 0), 100)], [(record(0.08, 0), 180)]])
    rows = on + off
    add_uncached_ratios(rows, uncached_twins({"tiny", "tiny@prefix_caching=false"}))
    assert uncached_twins({"v@prefix_caching=true", "v@prefix_caching=false", "w"}) == {
        "v@prefix_caching=true": "v@prefix_caching=false"
    }
    assert [r["turn"] for r in on] == [1, 2] and on[1]["cached_tokens_mean"] == 96
    assert on[1]["ttft_vs_uncached"] == pytest.approx(0.25) and "ttft_vs_uncached" not in off[0]
    history = conversation_turn([{"role": "system", "content": "s"}], 0)
    assert [m["role"] for m in history] == ["system", "user"]
    # The override that makes the uncached twin: every thinker stage, nothing else.
    label, path = resolve_config("stage_configs/ci/qwen3_omni_tiny_pd.yaml@prefix_caching=false", tmp_path)
    assert label == "qwen3_omni_tiny_pd@prefix_caching=false"
    stages = load_pipeline_config(path).stages
    assert [s.engine_args.enable_prefix_caching for s in stages if s.model_stage == "thinker"] == [
        False,
        False,
    ]
    assert all(s.engine_args.enable_prefix_caching is None for s in stages if s.model_stage != "thinker")
    # On a vLLM P/D pair it turns the prefill stage's on and leaves the decode stage's (which
    # refuses it: its prompt's KV is pulled) alone.
    _, path = resolve_config("stage_configs/ci/qwen3_omni_tiny_vllm_pd.yaml@prefix_caching=true", tmp_path)
    thinkers = [s.engine_args for s in load_pipeline_config(path).stages if s.model_stage == "thinker"]
    assert [a.enable_prefix_caching for a in thinkers] == [True, None]


def test_audio_turns_carry_a_distinct_seeded_clip_the_server_decodes():
    from omni_pd.bench.multi_turn import _text_chars, conversation_turn, spoken_clip
    from omni_pd.audio_io import decode_audio

    clip = spoken_clip(0, 1, seconds=0.5)
    samples = decode_audio(clip["input_audio"]["data"], clip["input_audio"]["format"])
    assert samples.shape == (8_000,) and samples.std() > 0.05
    assert spoken_clip(0, 1, seconds=0.5) == clip  # seeded: the same turn, the same bytes
    assert spoken_clip(0, 2, seconds=0.5) != clip and spoken_clip(1, 1, seconds=0.5) != clip
    messages = conversation_turn([{"role": "system", "content": "sys"}], 0, clip)
    assert messages[-1]["content"][1] is clip
    assert _text_chars(messages) == 3 + len(messages[-1]["content"][0]["text"])
