"""Prometheus metrics of the OpenAI server (one registry per app, so tests can run several).

Per-stage metrics carry two labels, as Prometheus users expect: `stage` (the stage id, "0") and
`stage_name` (what it runs, "thinker prefill"), so a query can select or group by either; the
replica metrics add `replica`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STAGE = ["stage", "stage_name"]
REPLICA = [*STAGE, "replica"]


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "omni_pd_requests", "Chat completion requests by outcome", ["outcome"], registry=self.registry
        )
        self.in_flight = Gauge("omni_pd_requests_in_flight", "Requests being served", registry=self.registry)
        self.queued = Gauge(
            "omni_pd_requests_queued",
            "Requests waiting for the stages to admit them (--max-queued-requests)",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "omni_pd_time_to_first_token_seconds",
            "Time to the first text token, from the request's arrival at the server to its first "
            "chunk's send (streamed chat) or to the first token (otherwise)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "omni_pd_request_latency_seconds",
            "End-to-end request latency",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stage = Histogram(
            "omni_pd_stage_latency_seconds",
            "Per-stage latency",
            STAGE,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttfa = Histogram(
            "omni_pd_time_to_first_audio_seconds",
            "Time to the first audio chunk handed to the client",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # A request's timeline: when each stage started and ended, since the request arrived.
        self.stage_start = Histogram(
            "omni_pd_stage_start_seconds",
            "When a stage started on a request, since its arrival",
            STAGE,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stage_end = Histogram(
            "omni_pd_stage_end_seconds",
            "When a stage finished a request, since its arrival",
            STAGE,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.audio_chunks = Counter(
            "omni_pd_audio_chunks", "Audio chunks handed to clients", registry=self.registry
        )
        self.kv_bytes = Counter(
            "omni_pd_kv_transferred_bytes", "KV bytes moved prefill -> decode", registry=self.registry
        )
        self.kv_reused = Counter(
            "omni_pd_kv_reused_bytes",
            "Prompt KV bytes the decode side held already (not moved)",
            registry=self.registry,
        )
        self.kv_handoff = Histogram(
            "omni_pd_kv_handoff_seconds",
            "KV transfer time per request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # Faults, read from the orchestrator's health report at each scrape.
        self.stage_up = Gauge(
            "omni_pd_stage_up", "1 when the stage is up and answering", STAGE, registry=self.registry
        )
        self.stage_restarts = Counter(
            "omni_pd_stage_restarts", "Worker restarts", STAGE, registry=self.registry
        )
        self.kv_breaker_open = Gauge(
            "omni_pd_kv_breaker_open",
            "1 while the P/D handoff breaker is open or half-open",
            registry=self.registry,
        )
        self.kv_handoff_failures = Counter(
            "omni_pd_kv_handoff_failures", "Failed or exhausted KV handoffs", registry=self.registry
        )
        self.kv_fallbacks = Counter(
            "omni_pd_kv_fallbacks",
            "Requests the P/D pair served without its prefill side",
            registry=self.registry,
        )
        # Replicas: requests routed to each, and each one's load now (requests in flight).
        self.stage_requests = Counter(
            "omni_pd_stage_requests", "Requests routed to a stage replica", REPLICA, registry=self.registry
        )
        self.stage_load = Gauge(
            "omni_pd_stage_load",
            "Requests in flight on a stage replica (routed, not finished)",
            REPLICA,
            registry=self.registry,
        )
        # Prefix caching (vLLM's counter names): prompt tokens looked up and found cached, per
        # stage replica; the hit rate is hits / queries.
        self.prefix_queries = Counter(
            "omni_pd_prefix_cache_queries",
            "Prompt tokens looked up in a stage's prefix cache",
            REPLICA,
            registry=self.registry,
        )
        self.prefix_hits = Counter(
            "omni_pd_prefix_cache_hits",
            "Prompt tokens found in a stage's prefix cache",
            REPLICA,
            registry=self.registry,
        )
        # The scheduler of each autoregressive stage replica (what a vLLM dashboard reads:
        # vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc, vllm:num_preemptions).
        self.sched_running = Gauge(
            "omni_pd_num_requests_running",
            "Requests a stage replica is computing (decoding, prefilling or reading their KV)",
            REPLICA,
            registry=self.registry,
        )
        self.sched_waiting = Gauge(
            "omni_pd_num_requests_waiting",
            "Requests a stage replica holds but has not admitted (preempted ones included)",
            REPLICA,
            registry=self.registry,
        )
        self.kv_usage = Gauge(
            "omni_pd_kv_cache_usage_perc",
            "Share of a stage replica's KV blocks in use (1 = full; idle cached blocks are free)",
            REPLICA,
            registry=self.registry,
        )
        self.preemptions = Counter(
            "omni_pd_num_preemptions",
            "Requests a stage replica preempted because its KV blocks ran out",
            REPLICA,
            registry=self.registry,
        )
        # The Realtime API: open sessions, and responses by how they ended.
        self.realtime_sessions = Gauge(
            "omni_pd_realtime_sessions", "Open /v1/realtime sessions", registry=self.registry
        )
        self.realtime_responses = Counter(
            "omni_pd_realtime_responses",
            "Realtime responses by status (completed, incomplete, cancelled, failed)",
            ["status"],
            registry=self.registry,
        )
        self._seen: dict[str, float] = {}  # the orchestrator's counts at the previous scrape
        self._stage_names: dict[str, str] = {}  # stage id -> name, from the health reports

    def name_stages(self, report: dict) -> None:
        """Learn each stage's name from a health report (`AsyncOmni.health`), for the requests'
        per-stage latencies, which carry only ids."""
        for stage_id, stage in report["stages"].items():
            self._stage_names[stage_id] = stage["name"]

    def _advance(self, key: str, counter, value: float) -> None:
        counter.inc(max(value - self._seen.get(key, 0.0), 0.0))
        self._seen[key] = value

    def observe_health(self, report: dict) -> None:
        self.name_stages(report)
        for stage_id, stage in report["stages"].items():
            labels = {"stage": stage_id, "stage_name": stage["name"]}
            self.stage_up.labels(**labels).set(1 if stage["responsive"] else 0)
            self._advance(f"restarts:{stage_id}", self.stage_restarts.labels(**labels), stage["restarts"])
            for k, replica in enumerate(stage.get("replicas", ())):
                load, at = replica["load"], {**labels, "replica": str(k)}
                self._advance(f"routed:{stage_id}:{k}", self.stage_requests.labels(**at), load["routed"])
                self.stage_load.labels(**at).set(load["in_flight"])
                if "preemptions" in load:
                    self._observe_scheduler(load, at, f"{stage_id}:{k}")
                if "prefix_cache_queries" in load:
                    self._advance(
                        f"prefix_q:{stage_id}:{k}",
                        self.prefix_queries.labels(**at),
                        load["prefix_cache_queries"],
                    )
                    self._advance(
                        f"prefix_h:{stage_id}:{k}", self.prefix_hits.labels(**at), load["prefix_cache_hits"]
                    )
        handoff = report.get("kv_handoff")
        if handoff is not None:
            self.kv_breaker_open.set(0 if handoff["breaker"] == "closed" else 1)
            self._advance("failures", self.kv_handoff_failures, handoff["failures"])
            self._advance("fallbacks", self.kv_fallbacks, handoff["fallbacks"])

    def _observe_scheduler(self, load: dict, labels: dict, key: str) -> None:
        self.sched_running.labels(**labels).set(load["running"])
        self.sched_waiting.labels(**labels).set(load["waiting"])
        self.kv_usage.labels(**labels).set(load["used_kv_blocks"] / max(load["kv_blocks"], 1))
        self._advance(f"preempt:{key}", self.preemptions.labels(**labels), load["preemptions"])

    def observe(self, metrics: dict, ttft_ms: float | None = None) -> None:
        """A finished request's metrics; `ttft_ms`: its TTFT as the server timed it from the
        request's arrival (hop_trace.HopTrace.ttft_ms), else the orchestrator's."""
        ttft_ms = ttft_ms if ttft_ms is not None else metrics.get("ttft_ms")
        if ttft_ms is not None:
            self.ttft.observe(ttft_ms / 1e3)
        self.e2e.observe(metrics["e2e_ms"] / 1e3)
        timeline = metrics.get("timeline") or {}
        spans = timeline.get("stages", {})
        for stage, ms in metrics.get("stage_ms", {}).items():
            # A stage whose span was dropped (a failed P/D handoff's prefill leg) has no name in
            # the timeline; the health report's is the same.
            name = spans[stage]["name"] if stage in spans else self._stage_names.get(stage, "")
            self.stage.labels(stage=stage, stage_name=name).observe(ms / 1e3)
        if metrics.get("ttfa_ms") is not None:
            self.ttfa.observe(metrics["ttfa_ms"] / 1e3)
        for stage, span in spans.items():
            self.stage_start.labels(stage=stage, stage_name=span["name"]).observe(span["start_ms"] / 1e3)
            self.stage_end.labels(stage=stage, stage_name=span["name"]).observe(span["end_ms"] / 1e3)
        self.audio_chunks.inc(len(timeline.get("audio_chunks_ms", ())))
        if "kv_bytes_reused" in metrics:
            self.kv_reused.inc(metrics["kv_bytes_reused"])
        if "kv_bytes_transferred" in metrics:
            self.kv_bytes.inc(metrics["kv_bytes_transferred"])
            self.kv_handoff.observe(metrics["kv_transfer_ms"] / 1e3)
