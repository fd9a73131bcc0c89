"""The planner's simulation (plan/simulate.py) on synthetic costs, checked by hand: a request
alone has TTFT = its prefill and TPOT = the decode step (colocated) or that plus the handoff's
hop and copy spread over its tokens (P/D); chunks cost what the form says; a rate past capacity
saturates; the P/D prefill queue matches DistServe's M/D/1 formula; and colocated and P/D order
as the arithmetic says under a tight and a loose ITL SLO."""

from __future__ import annotations

import statistics

import pytest

from omni_pd.plan.costs import Fit, StepCosts
from omni_pd.plan.layouts import parse_layout
from omni_pd.plan.planner import Config, PlanInputs, predict, recommend
from omni_pd.plan.simulate import Contention, EngineArgs, Handoff, simulate
from omni_pd.plan.slo import SloPair, summarize
from omni_pd.plan.workload import Lengths, Workload, arrivals


def _costs(prefill=(100.0, 2.0, 0.0), decode=(50.0, 5.0, 0.0)) -> StepCosts:
    return StepCosts(Fit(prefill, 0.0, 1, 4096), Fit(decode, 0.0, 1, 64), 1, "cpu", "synthetic")


HANDOFF = Handoff(hop_ms=2.0, bytes_per_token=1000.0, bandwidth=1e9)  # copy: 3 x 500 KB / 1 GB/s


def _alone(layout: str, prompt: int, output: int, costs: StepCosts, budget: int = 8192):
    run = simulate(
        parse_layout(layout),
        costs,
        EngineArgs(max_num_batched_tokens=budget),
        HANDOFF,
        [(prompt, output)],
        [0.0],
    )
    [record] = run.records
    return record.ttft_s * 1e3, (record.e2e_s - record.ttft_s) / (output - 1) * 1e3


def test_one_request_alone_colocated_ttft_is_its_prefill_and_tpot_the_decode_step():
    ttft, tpot = _alone("colocated-1x", 500, 11, _costs())
    assert ttft == pytest.approx(100 + 2 * 500)
    assert tpot == pytest.approx(50 + 5 * 1)


def test_one_request_alone_pd_adds_the_hop_and_the_copy_once():
    ttft, tpot = _alone("1P1D", 500, 11, _costs())
    assert ttft == pytest.approx(1100)  # the first token leaves with the prefill leg
    copy_ms = 3 * 500 * 1000 / 1e9 * 1e3
    assert tpot == pytest.approx((2.0 + copy_ms + 10 * 55) / 10)


def test_a_prompt_over_the_budget_runs_in_chunks_each_attending_to_the_ones_before():
    costs = _costs(prefill=(100.0, 2.0, 0.001))
    ttft, _ = _alone("colocated-1x", 1000, 2, costs, budget=256)
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    expected = sum(100 + 2 * t + 0.001 * t * (s + (t + 1) / 2) for t, s in chunks)
    assert ttft == pytest.approx(expected)
    whole, _ = _alone("colocated-1x", 1000, 2, costs)
    assert whole == pytest.approx(100 + 2000 + 0.001 * 1000 * 1001 / 2) and whole < ttft


def _served(layout: str, rate: float, n: int = 200) -> float:
    pairs = [(500, 2)] * n
    run = simulate(
        parse_layout(layout),
        _costs(decode=(1.0, 0.0, 0.0)),
        EngineArgs(),
        HANDOFF,
        pairs,
        arrivals(rate, n, 0),
    )
    return len(run.records) / run.wall_s


def test_past_capacity_the_served_rate_saturates():
    # 1P1D's prefill leg does 2 ms a token, 1000 ms per 500-token prompt (plus 100 ms a pass,
    # shared by the prompts batched in it): at most 1 req/s.
    low, high, higher = _served("1P1D", 0.3), _served("1P1D", 4.0), _served("1P1D", 8.0)
    assert low == pytest.approx(0.3, rel=0.15)
    assert 0.85 < high <= 1.0 and 0.85 < higher <= 1.0
    assert higher == pytest.approx(high, rel=0.05)


def test_the_pd_prefill_queue_matches_the_md1_formula():
    # One 500-token prompt per prefill step (budget = the prompt): service D = 1.1 s, FIFO.
    d, rho, n = 1.1, 0.5, 4000
    pairs = [(500, 2)] * n
    run = simulate(
        parse_layout("1P1D"),
        _costs(decode=(1.0, 0.0, 0.0)),
        EngineArgs(max_num_batched_tokens=500),
        HANDOFF,
        pairs,
        arrivals(rho / d, n, 3),
    )
    mean_ttft = statistics.fmean(r.ttft_s for r in run.records)
    assert mean_ttft == pytest.approx(d + rho * d / (2 * (1 - rho)), rel=0.05)


def _ordering_inputs(slo: SloPair) -> PlanInputs:
    costs = _costs(prefill=(0.0, 1.0, 0.0), decode=(50.0, 0.0, 0.0))
    workload = Workload(Lengths(1000, 1000), Lengths(41, 41), seed=0, template_tokens=0)
    return PlanInputs(workload, [0.4, 0.8, 1.5], 200, EngineArgs(), HANDOFF, [slo], lambda threads: costs)


def test_colocated_and_pd_order_as_the_arithmetic_says():
    """Prompts of 1 s of prefill, 40 decode steps of 50 ms. Under ITL <= 60 ms a colocated
    request fails whenever a prompt lands on its replica while it decodes (1 s over 40 tokens
    adds 25 ms a token), P/D's never does: P/D wins. Under ITL <= 500 ms, P/D's one prefill
    worker serves at most 1 req/s, two colocated replicas nearly 2: colocated wins at 1.5 req/s."""
    configs = [
        Config(parse_layout("1P1D"), 8192, 1),
        Config(parse_layout("colocated-2x"), 8192, 1),
    ]
    tight = SloPair("tight", 5000.0, 60.0)
    loose = SloPair("loose", 5000.0, 500.0)
    tight_preds = predict(configs, _ordering_inputs(tight))
    loose_preds = predict(configs, _ordering_inputs(loose))
    assert recommend(tight_preds, "tight").config.layout.label == "1P1D"
    assert recommend(loose_preds, "loose").config.layout.label == "colocated-2x"
    pd_peak = max(p.goodput for p in loose_preds if p.config.layout.disaggregated)
    assert pd_peak <= 1.0  # its prefill worker's capacity
    colocated_tpot = [p.row["tpot_ms_p50"] for p in tight_preds if not p.config.layout.disaggregated]
    assert max(colocated_tpot) > 60  # the mixed steps are what fail the tight SLO


def test_every_simulated_request_is_summarised_as_the_bench_does():
    run = simulate(
        parse_layout("colocated-2x"), _costs(), EngineArgs(), HANDOFF, [(300, 5)] * 8, arrivals(2.0, 8, 0)
    )
    row = summarize(run, SloPair("x", 10_000.0, 1_000.0))
    assert row["num_requests"] == 8 and row["slo_attainment"] == 1.0
    assert row["goodput_req_per_s"] == pytest.approx(8 / run.wall_s)
    strict = summarize(run, SloPair("x", 1.0, 1_000.0))  # no prefill is that fast
    assert strict["goodput_req_per_s"] == 0.0


def _pd_tpot_ms(contention: Contention, layout: str = "1P1D") -> float:
    """Two requests 0.5 s apart: the second's prefill runs while the first decodes."""
    run = simulate(
        parse_layout(layout),
        _costs(),
        EngineArgs(),
        HANDOFF,
        [(500, 41), (500, 41)],
        [0.0, 0.5],
        contention=contention,
    )
    first = run.records[0]
    return (first.e2e_s - first.ttft_s) / 40 * 1e3


def test_contention_slows_the_steps_that_run_beside_another_worker_only():
    quiet = _pd_tpot_ms(Contention())
    contended = _pd_tpot_ms(Contention(prefill=1.5, decode=2.0))
    # The first request decodes 40 steps of 55 ms; the second's 1,100 ms prefill overlaps some
    # of them, each of which then costs 110 ms: slower, but less than every step doubled.
    assert quiet < contended < 2 * quiet
    # One worker has no neighbour: the same factors change nothing.
    alone = _pd_tpot_ms(Contention(), "colocated-1x")
    assert _pd_tpot_ms(Contention(prefill=1.5, decode=2.0), "colocated-1x") == pytest.approx(alone)
