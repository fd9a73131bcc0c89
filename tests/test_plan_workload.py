"""The planner's workload (plan/workload.py) draws what `bench serve` draws: `N` and
`uniform:LO:HI` parse, anything else is refused naming the flag; the seeded lengths are the bench
workload module's own (where it is present), with the chat template's tokens added; the arrivals
are the bench's Poisson process."""

from __future__ import annotations

import pytest

from omni_pd.bench.load import poisson_arrivals
from omni_pd.plan.errors import PlanError
from omni_pd.plan.workload import Lengths, Workload, arrivals, parse_lengths


def test_lengths_parse_as_the_bench_writes_them():
    assert parse_lengths("64", "--output-tokens") == Lengths(64, 64)
    assert parse_lengths("uniform:256:1024", "--prompt-tokens") == Lengths(256, 1024)
    assert str(Lengths(256, 1024)) == "uniform:256:1024" and str(Lengths(5, 5)) == "5"


@pytest.mark.parametrize("text", ["uniform:5", "uniform:9:3", "normal:1:2", "x", "0", "uniform:0:4"])
def test_a_length_that_does_not_parse_is_refused_naming_the_flag(text):
    with pytest.raises(PlanError, match="--prompt-tokens takes N or uniform:LO:HI"):
        parse_lengths(text, "--prompt-tokens")


def test_draws_are_seeded_add_the_template_and_stay_in_bounds():
    w = Workload(Lengths(256, 1024), Lengths(16, 64), seed=3, template_tokens=8)
    pairs = w.pairs(200)
    assert pairs == w.pairs(200) and pairs[:50] == w.pairs(50)  # a shorter run sees a prefix
    assert pairs != Workload(Lengths(256, 1024), Lengths(16, 64), seed=4).pairs(200)
    assert all(264 <= p <= 1032 and 16 <= o <= 64 for p, o in pairs)
    assert w.median_prompt == 648 and w.median_context == 648 + 20


def test_the_lengths_are_the_bench_workloads_own():
    bench = pytest.importorskip(
        "omni_pd.bench.workload", reason="bench serve's workload module is not on this branch"
    )
    theirs = bench.Workload(bench.Lengths(256, 1024), bench.Lengths(16, 64), seed=7).pairs(64)
    mine = Workload(Lengths(256, 1024), Lengths(16, 64), seed=7, template_tokens=8).pairs(64)
    assert mine == [(p + 8, o) for p, o in theirs]


def test_the_arrivals_are_the_bench_poisson_process():
    assert arrivals(0.3, 40, 5) == poisson_arrivals(0.3, 40, 5)
    assert arrivals(0.3, 40, 5) != arrivals(0.3, 40, 6)
