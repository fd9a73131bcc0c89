"""`omni-pd bench serve` statistics on synthetic numbers: percentiles, throughput, ratios, nulls."""

import json
import math

import numpy as np
import pytest

from omni_pd.bench.report import format_table, write_json
from omni_pd.bench.stats import (
    METRIC_KEYS,
    RequestRecord,
    add_ratios,
    percentiles_ms,
    ratio,
    summarize_level,
    vs_config_key,
)


def _ok(ttft, ttfa, e2e, itl=(), tokens=24):
    return RequestRecord(ok=True, ttft_s=ttft, ttfa_s=ttfa, e2e_s=e2e, itl_s=list(itl), output_tokens=tokens)


def test_percentiles_are_numpy_percentiles_in_ms():
    values = [0.010, 0.020, 0.030, 0.040, 0.100]
    p50, p99 = percentiles_ms(values)
    assert p50 == pytest.approx(np.percentile(values, 50) * 1e3) == pytest.approx(30.0)
    assert p99 == pytest.approx(np.percentile(values, 99) * 1e3)
    assert 40.0 < p99 < 100.0


def test_percentiles_leave_out_missing_values_and_are_none_when_empty():
    assert percentiles_ms([None, 0.5, float("nan")]) == [pytest.approx(500.0), pytest.approx(500.0)]
    assert percentiles_ms([]) == [None, None]
    assert percentiles_ms([None]) == [None, None]


def test_ratio_is_none_for_missing_or_non_positive_denominators():
    assert ratio(3.0, 1.5) == pytest.approx(2.0)
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None and ratio(1.0, float("nan")) is None


def test_summarize_level_counts_successes_for_throughput_and_latency():
    records = [
        _ok(0.01, 0.10, 0.20, itl=[0.005, 0.007], tokens=24),
        _ok(0.03, 0.30, 0.40, itl=[0.009], tokens=20),
        RequestRecord(ok=False, error="boom"),
    ]
    row = summarize_level(records, wall_s=2.0)
    assert set(METRIC_KEYS) <= set(row)
    assert row["num_requests"] == 3 and row["completed"] == 2 and row["errors"] == 1
    assert row["req_per_s"] == pytest.approx(1.0)  # 2 done in 2 s
    assert row["output_tok_per_s"] == pytest.approx(22.0)  # 44 tokens in 2 s
    assert row["ttft_ms_p50"] == pytest.approx(20.0)
    assert row["ttfa_ms_p50"] == pytest.approx(200.0)
    assert row["e2e_ms_p50"] == pytest.approx(300.0)
    assert row["itl_ms_p50"] == pytest.approx(7.0)  # gaps pooled: 5, 7, 9 ms
    for name in ("ttft", "ttfa", "itl", "e2e"):
        assert row[f"{name}_ms_p99"] >= row[f"{name}_ms_p50"] >= 0


def test_summarize_level_gives_none_not_nan_when_nothing_can_be_computed():
    row = summarize_level([RequestRecord(ok=False, error="x")] * 2, wall_s=1.0)
    assert row["errors"] == 2 and row["req_per_s"] is None and row["output_tok_per_s"] is None
    assert all(row[f"{n}_ms_{p}"] is None for n in ("ttft", "ttfa", "itl", "e2e") for p in ("p50", "p99"))
    # One content chunk per request: no inter-token gap, so ITL is None while the rest is set.
    row = summarize_level([_ok(0.01, 0.02, 0.03)], wall_s=0.5)
    assert row["itl_ms_p50"] is None and row["itl_ms_p99"] is None
    assert row["e2e_ms_p50"] == pytest.approx(30.0)


def _row(config, concurrency, req_per_s, e2e_p50):
    return {"config": config, "concurrency": concurrency, "req_per_s": req_per_s, "e2e_ms_p50": e2e_p50}


def test_ratios_against_the_lowest_level_and_the_first_config():
    results = add_ratios(
        [
            _row("a", 4, 6.0, 400.0),
            _row("a", 1, 2.0, 100.0),  # order does not matter
            _row("b", 1, 1.0, 200.0),
            _row("b", 4, 3.0, None),
            _row("b", 8, 4.0, 500.0),  # no level 8 for "a"
        ]
    )
    a4, a1, b1, b4, b8 = results
    assert a1["req_per_s_vs_c1"] == pytest.approx(1.0) and a1["e2e_p50_vs_c1"] == pytest.approx(1.0)
    assert a4["req_per_s_vs_c1"] == pytest.approx(3.0) and a4["e2e_p50_vs_c1"] == pytest.approx(4.0)
    assert b4["req_per_s_vs_c1"] == pytest.approx(3.0) and b4["e2e_p50_vs_c1"] is None
    assert all(r["ratio_baseline_concurrency"] == 1 for r in results)
    key = vs_config_key("a")
    assert key == "req_per_s_vs_a"
    assert b1[key] == pytest.approx(0.5) and b4[key] == pytest.approx(0.5) and b8[key] is None
    assert key not in a1 and key not in a4


def test_ratios_with_one_config_and_a_lowest_level_above_one():
    results = add_ratios([_row("only", 2, 4.0, 10.0), _row("only", 8, None, 20.0)])
    assert results[0]["ratio_baseline_concurrency"] == 2
    assert results[0]["req_per_s_vs_c1"] == pytest.approx(1.0)
    assert results[1]["req_per_s_vs_c1"] is None and results[1]["e2e_p50_vs_c1"] == pytest.approx(2.0)
    assert not any(k.startswith("req_per_s_vs_") and k != "req_per_s_vs_c1" for r in results for k in r)


def test_vs_config_key_makes_a_plain_key_of_any_label():
    assert vs_config_key("qwen3_omni_tiny") == "req_per_s_vs_qwen3_omni_tiny"
    assert vs_config_key("127.0.0.1:8000") == "req_per_s_vs_127_0_0_1_8000"


def test_json_holds_null_for_none_and_nan_and_the_table_shows_a_dash(tmp_path):
    row = {
        "config": "a",
        "concurrency": 1,
        "num_requests": 2,
        **summarize_level([_ok(0.01, 0.02, 0.03)], wall_s=float("nan")),
    }
    add_ratios([row])
    path = tmp_path / "out.json"
    write_json(path, {"max_tokens": 24}, [row])
    text = path.read_text()
    assert "NaN" not in text
    loaded = json.loads(text)["results"][0]
    assert loaded["req_per_s"] is None and loaded["itl_ms_p50"] is None
    assert loaded["ttft_ms_p50"] == pytest.approx(10.0) and not math.isnan(loaded["ttft_ms_p50"])
    table = format_table([row]).splitlines()
    assert len(table) == 3 and table[0].split()[0] == "config" and " - " in table[2]


def test_config_overrides_make_a_labelled_copy(tmp_path):
    import yaml

    from omni_pd.bench.serve_configs import unique_labels, resolve_config

    label, path = resolve_config("stage_configs/ci/qwen3_omni_tiny_pd.yaml@async_chunk=false", tmp_path)
    assert label == "qwen3_omni_tiny_pd@async_chunk=false"
    data = yaml.safe_load(path.read_text())
    assert data["async_chunk"] is False and len(data["stage_args"]) == 4
    plain_label, plain = resolve_config("stage_configs/ci/qwen3_omni_tiny_pd.yaml", tmp_path)
    assert yaml.safe_load(plain.read_text())["async_chunk"] is True
    assert unique_labels([plain_label, plain_label]) == ["qwen3_omni_tiny_pd", "qwen3_omni_tiny_pd-2"]
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        resolve_config("stage_configs/ci/qwen3_omni_tiny_pd.yaml@async_chunk", tmp_path)


def test_transfer_mode_and_load_format_overrides_reach_the_stages(tmp_path):
    import yaml

    from omni_pd.bench.serve_configs import resolve_config

    pd = "stage_configs/ci/qwen3_omni_tiny_pd.yaml"
    label, path = resolve_config(f"{pd}@transfer_mode=push@load_format=auto@kv_same_host=off", tmp_path)
    assert label == "qwen3_omni_tiny_pd@transfer_mode=push@load_format=auto@kv_same_host=off"
    stages = yaml.safe_load(path.read_text())["stage_args"]
    extra = [s["engine_args"]["kv_transfer_config"]["kv_connector_extra_config"] for s in stages[:2]]
    assert [e["kv_same_host"] for e in extra] == ["off", "off"]
    modes = [
        (s["engine_args"].get("kv_transfer_config") or {})
        .get("kv_connector_extra_config", {})
        .get("transfer_mode")
        for s in stages
    ]
    assert modes == ["push", "push", None, None]
    assert all(s["engine_args"]["load_format"] == "auto" for s in stages)
    # the copy loads (push named on both legs of the pair is allowed) ...
    from omni_pd.config.loader import load_pipeline_config

    load_pipeline_config(path)
    # ... and the plain file keeps pull (the default) and dummy weights
    _, plain = resolve_config(pd, tmp_path)
    assert "transfer_mode" not in plain.read_text() and "load_format: dummy" in plain.read_text()
    with pytest.raises(SystemExit, match="transfer_mode needs a P/D config"):
        resolve_config("stage_configs/ci/qwen3_omni_tiny.yaml@transfer_mode=push", tmp_path)


def test_sized_prompts_have_the_length_asked_and_no_shared_prefix():
    from omni_pd.bench.sized_prompts import load_tokenizer, sized_prompts

    tokenizer = load_tokenizer("tiny-qwen3-omni")
    made = sized_prompts(tokenizer, 300, 3) + sized_prompts(tokenizer, 300, 2, first=3)
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in made]
    assert lengths == [300] * 5
    assert len({p[:12] for p in made}) == 5  # each begins with its own number
    with pytest.raises(ValueError, match="--prompt-tokens must be at least 8"):
        sized_prompts(tokenizer, 4, 1)


def test_ignore_eos_sets_every_stage_of_the_copy(tmp_path):
    import yaml

    from omni_pd.bench.serve_configs import resolve_config

    label, path = resolve_config("stage_configs/ci/qwen3_omni_tiny.yaml", tmp_path, ignore_eos=True)
    stages = yaml.safe_load(path.read_text())["stage_args"]
    assert label == "qwen3_omni_tiny" and len(stages) == 3
    assert all(stage["default_sampling_params"]["ignore_eos"] is True for stage in stages)
    # the talker keeps its own sampling settings beside it
    assert stages[1]["default_sampling_params"]["max_tokens"] == 64
    # without the flag the shipped file is served as it is: no ignore_eos anywhere
    _, plain = resolve_config("stage_configs/ci/qwen3_omni_tiny.yaml", tmp_path)
    assert not any(
        "ignore_eos" in (s.get("default_sampling_params") or {})
        for s in yaml.safe_load(plain.read_text())["stage_args"]
    )


def test_pd_ttft_overhead_is_ttft_beyond_colocated_minus_the_handoff():
    colocated = {**_row("col", 1, 4.0, 200.0), "ttft_ms_p50": 10.0, "kv_handoff_ms_mean": None}
    pd = {**_row("pd", 1, 4.0, 210.0), "ttft_ms_p50": 14.5, "kv_handoff_ms_mean": 1.5}
    pd_no_base = {**_row("pd", 4, 6.0, 300.0), "ttft_ms_p50": 20.0, "kv_handoff_ms_mean": 2.0}
    add_ratios([colocated, pd, pd_no_base])
    assert pd["pd_ttft_overhead_ms"] == pytest.approx(3.0)
    assert "pd_ttft_overhead_ms" not in pd_no_base  # no colocated row at that level
    assert "pd_ttft_overhead_ms" not in colocated


def test_mean_handoff_comes_from_the_histogram_delta_of_one_level():
    from omni_pd.bench.serve_target import _mean_handoff_ms

    assert _mean_handoff_ms((0.010, 4), (0.016, 7)) == pytest.approx(2.0)
    assert _mean_handoff_ms((0.010, 4), (0.010, 4)) is None  # colocated: no handoff observed
    assert _mean_handoff_ms(None, (1.0, 3)) is None


def test_requests_per_level_default_is_several_waves_of_the_concurrency():
    from omni_pd.bench.serve_target import DEFAULT_NUM_REQUESTS, WAVES, requests_per_level

    # Unset: WAVES x the concurrency, so a level is not one burst; never fewer than the floor.
    assert [requests_per_level(None, c) for c in (1, 4, 8, 16)] == [
        DEFAULT_NUM_REQUESTS,
        DEFAULT_NUM_REQUESTS,
        WAVES * 8,
        WAVES * 16,
    ]
    # Given: taken as it is, but never fewer than the requests in flight.
    assert requests_per_level(10, 4) == 10 and requests_per_level(2, 8) == 8
