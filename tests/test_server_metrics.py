"""The server's Prometheus metrics: per-stage series labelled `stage` (the id) and `stage_name`,
and examples/grafana_dashboard.json querying only metrics and labels that /metrics exports."""

from __future__ import annotations

import copy

from prometheus_client import generate_latest

from dashboard_check import Exposition, label_names, load_dashboard, metric_names, problems, queries
from omni_pd.entrypoints.openai.metrics import ServerMetrics

STAGES = {"0": "thinker prefill", "1": "thinker decode", "2": "talker", "3": "code2wav"}


def _health() -> dict:
    """A P/D server's health report (AsyncOmni.health), two thinker prefill replicas."""

    def replica(k: int, thinker: bool) -> dict:
        load = {"routed": 3 + k, "in_flight": k}
        if thinker:
            load.update(prefix_cache_queries=40, prefix_cache_hits=16)
            load.update(running=2 + k, waiting=1, used_kv_blocks=30, kv_blocks=120, preemptions=4)
        return {"load": load}

    return {
        "status": "ok",
        "kv_handoff": {"breaker": "closed", "failures": 1, "fallbacks": 1},
        "stages": {
            sid: {
                "name": name,
                "responsive": True,
                "restarts": int(sid == "2"),
                "replicas": [replica(k, "thinker" in name) for k in range(2 if sid == "0" else 1)],
            }
            for sid, name in STAGES.items()
        },
    }


def _request_metrics() -> dict:
    """A finished P/D request's metrics (AsyncOmni._finish), text and audio."""
    return {
        "ttft_ms": 9.0,
        "e2e_ms": 140.0,
        "ttfa_ms": 30.0,
        "stage_ms": {sid: 10.0 + int(sid) for sid in STAGES},
        "kv_bytes_transferred": 40960,
        "kv_transfer_ms": 0.2,
        "kv_bytes_reused": 0,
        "timeline": {
            "stages": {sid: {"name": name, "start_ms": 1.0, "end_ms": 20.0} for sid, name in STAGES.items()},
            "audio_chunks_ms": [30.0, 60.0],
        },
    }


def _served() -> ServerMetrics:
    """The registry a P/D server holds after a request of each kind and a scrape."""
    metrics = ServerMetrics()
    metrics.observe_health(_health())
    metrics.observe(_request_metrics())
    for outcome in ("success", "aborted", "overloaded"):
        metrics.requests.labels(outcome=outcome).inc()
    metrics.realtime_responses.labels(status="completed").inc()
    metrics.in_flight.set(0)
    metrics.queued.set(0)
    return metrics


def _samples(metrics: ServerMetrics, name: str) -> list[dict[str, str]]:
    return [
        sample.labels
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    ]


def test_stage_series_carry_the_id_and_the_name_apart():
    metrics = _served()
    for name in (
        "omni_pd_stage_up",
        "omni_pd_stage_restarts_total",
        "omni_pd_stage_latency_seconds_count",
        "omni_pd_stage_start_seconds_count",
        "omni_pd_stage_end_seconds_count",
    ):
        assert sorted((s["stage"], s["stage_name"]) for s in _samples(metrics, name)) == sorted(
            STAGES.items()
        ), name
    for name in ("omni_pd_stage_requests_total", "omni_pd_stage_load"):
        assert sorted((s["stage"], s["stage_name"], s["replica"]) for s in _samples(metrics, name)) == [
            ("0", "thinker prefill", "0"),
            ("0", "thinker prefill", "1"),
            ("1", "thinker decode", "0"),
            ("2", "talker", "0"),
            ("3", "code2wav", "0"),
        ], name
    assert {(s["stage"], s["stage_name"]) for s in _samples(metrics, "omni_pd_prefix_cache_hits_total")} == {
        ("0", "thinker prefill"),
        ("1", "thinker decode"),
    }
    # No label joins the two any more (it read stage="0:thinker prefill").
    text = generate_latest(metrics.registry).decode()
    assert 'omni_pd_stage_restarts_total{stage="2",stage_name="talker"} 1.0' in text
    assert ":thinker" not in text and ":talker" not in text


def test_a_stage_without_a_span_takes_its_name_from_the_health_report():
    """A failed handoff drops the prefill leg's span but keeps its latency."""
    metrics = ServerMetrics()
    metrics.observe_health(_health())
    request = _request_metrics()
    del request["timeline"]["stages"]["0"]
    metrics.observe(request)
    assert {"stage": "0", "stage_name": "thinker prefill"} in _samples(
        metrics, "omni_pd_stage_latency_seconds_count"
    )


def test_the_query_parser_finds_metrics_and_labels():
    expr = (
        "histogram_quantile(0.9, sum by (le, stage_name) (rate("
        'omni_pd_stage_latency_seconds_bucket{stage=~"0|1"}[$__rate_interval]))) * 1e3 '
        "/ on (stage) group_left sum(omni_pd_stage_up offset 5m)"
    )
    assert metric_names(expr) == {"omni_pd_stage_latency_seconds_bucket", "omni_pd_stage_up"}
    assert label_names(expr, "{{stage}} {{ replica }}") == {"le", "stage_name", "stage", "replica"}


def test_every_dashboard_query_names_metrics_the_server_exports():
    dashboard = load_dashboard()
    exposition = Exposition.parse(generate_latest(_served().registry).decode())
    used = set().union(*(metric_names(expr) for _, expr, _ in queries(dashboard)))
    assert len(queries(dashboard)) >= 20 and len(used) >= 20  # the panels the issue asks for
    assert problems(dashboard, exposition) == []


def test_the_dashboard_check_catches_a_metric_or_label_that_does_not_exist():
    """Negative controls: a made-up metric, a counter without `_total`, a misspelt label."""
    exposition = Exposition.parse(generate_latest(_served().registry).decode())
    dashboard = copy.deepcopy(load_dashboard())
    panel = next(p for p in dashboard["panels"] if p.get("targets"))
    panel["targets"] = [
        {"expr": "rate(omni_pd_no_such_metric_total[5m])", "refId": "A"},
        {"expr": "sum by (outcome) (rate(omni_pd_requests[5m]))", "refId": "B"},
        {"expr": "sum by (stage_nme) (omni_pd_stage_up)", "refId": "C"},
    ]
    found = problems(dashboard, exposition)
    assert len(found) == 3, found
    assert "omni_pd_no_such_metric_total is not exported" in found[0]
    assert "omni_pd_requests is not exported" in found[1]
    assert "the label 'stage_nme'" in found[2]


def test_scheduler_series_per_replica_as_a_vllm_dashboard_reads_them():
    metrics = _served()
    report = _health()
    report["stages"]["0"]["replicas"][1]["load"]["preemptions"] = 9  # a later scrape
    metrics.observe_health(report)

    def value(name: str, replica: str) -> float | None:
        return metrics.registry.get_sample_value(
            name, {"stage": "0", "stage_name": "thinker prefill", "replica": replica}
        )

    assert value("omni_pd_num_requests_running", "1") == 3
    assert value("omni_pd_num_requests_waiting", "0") == 1
    assert value("omni_pd_kv_cache_usage_perc", "0") == 0.25
    # A counter of the engine's running total: advanced by the difference, not added again.
    assert value("omni_pd_num_preemptions_total", "0") == 4
    assert value("omni_pd_num_preemptions_total", "1") == 9
    assert (
        metrics.registry.get_sample_value(
            "omni_pd_num_requests_running", {"stage": "2", "stage_name": "talker", "replica": "0"}
        )
        is None
    )  # a replica that reports no scheduler has no series
