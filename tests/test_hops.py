"""Hop stamps (omni_pd/hops.py) and the server's trace of them (hop_trace.py): the rows come in
the order the stamps happened, each with its time since the origin and since the row before."""

from omni_pd import hops
from omni_pd.entrypoints.openai.hop_trace import HopTrace


def test_a_stamp_keeps_the_first_pass_of_a_hop():
    metrics: dict = {"e2e_ms": 3.0}
    hops.stamp(metrics, "token 1", 10.0)
    hops.stamp(metrics, "token 1", 11.0)  # computed again after preemption: the first stays
    hops.stamp(metrics, "token 2", 12.5)
    assert hops.stamps(metrics) == {"token 1": 10.0, "token 2": 12.5}
    assert hops.without_stamps(metrics) == {"e2e_ms": 3.0}


def test_the_timeline_is_in_stamp_order_with_steps():
    rows = hops.timeline(100.0, [("b", "late", 100.004), ("a", "early", 100.001), ("a", "mid", 100.002)])
    assert [(r["where"], r["hop"]) for r in rows] == [("a", "early"), ("a", "mid"), ("b", "late")]
    assert [r["at_ms"] for r in rows] == [1.0, 2.0, 4.0]
    assert [r["step_ms"] for r in rows] == [1.0, 1.0, 2.0]


def test_the_server_joins_its_stamps_with_the_orchestrators():
    """The orchestrator's rows are since its own origin; the server puts them, with its own
    stamps, on one axis since it took the request. The control: the orchestrator's rows taken
    as if they were since the server's origin land 2 ms early."""
    trace = HopTrace(50.0)
    trace.stamps["first chunk out"] = 50.010
    inner = {
        "origin": 50.002,
        "hops": [{"where": "orchestrator", "hop": "arrived", "at_ms": 0.0, "step_ms": 0.0}],
    }
    joined = trace.timeline({"timeline": inner})
    assert joined["origin"] == 50.0
    assert [(r["where"], r["hop"], r["at_ms"]) for r in joined["hops"]] == [
        ("api server", "request in", 0.0),
        ("orchestrator", "arrived", 2.0),
        ("api server", "first chunk out", 10.0),
    ]
    naive = {r["hop"]: r["at_ms"] for r in inner["hops"]}
    assert naive["arrived"] != 2.0


def test_only_a_traced_stream_ends_with_the_timeline():
    """`--trace-hops` on: the chunk with the finish reason carries `omni_pd_timeline`, with the
    server's last-chunk stamp; off (the default, the control): no chunk does."""
    import json
    from types import SimpleNamespace

    from omni_pd.entrypoints.openai.chat_stream import _ChunkStream

    output = SimpleNamespace(finish_reason="stop", prompt_token_ids=[1], token_ids=[2], metrics={})

    def last_chunks(trace):
        stream = _ChunkStream("chatcmpl-x", 0, "m")
        stream.text("hi")
        return [json.loads(line.removeprefix("data: ")) for line in stream.finished(output, True, trace)]

    traced = last_chunks(HopTrace(1.0))
    assert [("omni_pd_timeline" in c) for c in traced] == [True, False]  # the finish chunk, not usage
    assert [r["hop"] for r in traced[0]["omni_pd_timeline"]["hops"]] == ["request in", "last chunk out"]
    assert not any("omni_pd_timeline" in c for c in last_chunks(None))
    assert not any("omni_pd_timeline" in c for c in last_chunks(HopTrace(1.0, publish=False)))


def test_the_servers_ttft_counts_from_the_requests_arrival():
    """Streamed: arrival to the first chunk's send. Not streamed: arrival to the orchestrator's
    first token (its ttft_ms counts from when the orchestrator took the request, 3 ms after the
    arrival here); the control is the orchestrator's own figure, 3 ms short."""
    metrics = {"ttft_ms": 10.0, "timeline": {"origin": 100.003, "hops": []}}
    whole = HopTrace(100.0, publish=False)
    assert round(whole.ttft_ms(metrics), 6) == 13.0 != metrics["ttft_ms"]
    streamed = HopTrace(100.0, publish=False)
    streamed.stamps["first chunk out"] = 100.0145
    assert round(streamed.ttft_ms(metrics), 6) == 14.5
    assert HopTrace(100.0).ttft_ms({"ttft_ms": None}) is None  # no first token (an empty answer)
