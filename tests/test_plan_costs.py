"""The planner's step-cost fit (plan/costs.py) and profile reader: a synthetic affine model is
recovered exactly, coefficients stay >= 0, a profile without the rows the forms need is refused
naming the roofline flags, and the recorded tiny-model profiles read and fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omni_pd.plan.costs import fit_costs, fit_nonnegative
from omni_pd.plan.errors import PlanError
from omni_pd.plan.profile import Profile, StepRow, read_profile

DATA = Path(__file__).parent / "data"
PRE = (40.0, 3.2, 0.0015)  # a, b per token, c per attention pair
DEC = (250.0, 10.5, 0.004)  # a, b per request, c per cached position


def _profile(
    prefill_tokens=(64, 256, 1024), prefill_batches=(1,), batches=(1, 4, 8, 16), contexts=(256, 1024)
):
    rows = [
        StepRow("thinker_prefill", b, t, 0, PRE[0] + PRE[1] * b * t + PRE[2] * b * t * (t + 1) / 2)
        for t in prefill_tokens
        for b in prefill_batches
    ] + [
        StepRow("thinker_decode", b, 1, c, DEC[0] + DEC[1] * b + DEC[2] * b * c)
        for b in batches
        for c in contexts
    ]
    return Profile("synthetic", "cpu", "float32", 1, 1e10, 1, tuple(rows))


def test_the_fit_recovers_a_synthetic_affine_model_exactly():
    costs = fit_costs(_profile())
    assert costs.prefill.coef == pytest.approx(PRE, rel=1e-9)
    assert costs.decode.coef == pytest.approx(DEC, rel=1e-9)
    assert costs.prefill.max_rel_err < 1e-9 and costs.decode.max_rel_err < 1e-9
    # A chunk of 256 after 768 cached: a + b*256 + c*256*(768 + 257/2).
    assert costs.prefill_ms([(256, 768)]) == pytest.approx(
        PRE[0] + PRE[1] * 256 + PRE[2] * 256 * (768 + 128.5)
    )
    assert costs.decode_ms(8, 8 * 1000) == pytest.approx(DEC[0] + DEC[1] * 8 + DEC[2] * 8000)
    assert (costs.prefill.lo, costs.prefill.hi, costs.decode.lo, costs.decode.hi) == (64, 1024, 1, 16)


def test_coefficients_stay_nonnegative():
    # Points that an unconstrained fit would give a negative intercept: y = 2x exactly, plus a
    # row that pulls the line below zero at x = 0.
    x = np.array([[1.0, 1.0, 0.0], [1.0, 2.0, 0.0], [1.0, 3.0, 0.0], [1.0, 10.0, 0.0]])
    y = np.array([1.0, 4.0, 6.0, 20.0])
    unconstrained, *_ = np.linalg.lstsq(x[:, :2] / y[:, None], np.ones(4), rcond=None)
    assert unconstrained[0] < 0  # the control: least squares alone goes negative here
    coef, _ = fit_nonnegative(x, y)
    assert min(coef) >= 0


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"prefill_tokens": (256, 1024)}, "--prefill-tokens"),
        ({"contexts": (1024,)}, "--contexts"),
        ({"batches": (8,)}, "--batches"),
    ],
    ids=["two-prompt-lengths", "one-context", "one-batch"],
)
def test_a_profile_lacking_rows_is_refused_naming_the_roofline_flags(kwargs, flag):
    with pytest.raises(PlanError, match="bench roofline") as info:
        fit_costs(_profile(**kwargs))
    message = str(info.value)
    assert flag in message and "\n" not in message
    other = "--batches" if flag == "--prefill-tokens" else "--prefill-tokens"
    assert other not in message  # it names what this profile lacks, not every flag


def test_the_recorded_tiny_profiles_read_and_fit():
    for threads in (1, 2):
        profile = read_profile(DATA / f"plan_roofline_tiny_t{threads}.json")
        assert profile.threads == threads and not profile.gpu and profile.bandwidth
        assert len(profile.stage("thinker_prefill")) == 3 and len(profile.stage("thinker_decode")) == 8
        costs = fit_costs(profile)
        assert costs.prefill.max_rel_err < 0.10 and costs.decode.max_rel_err < 0.15
        assert costs.prefill_ms([(1024, 0)]) > costs.prefill_ms([(64, 0)]) > 0


def test_a_gpu_profile_reads_the_same_way(tmp_path):
    data = json.loads((DATA / "plan_roofline_tiny_t1.json").read_text())
    data["device"] = "cuda:0"
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    profile = read_profile(path)
    assert (
        profile.gpu
        and fit_costs(profile).prefill.coef
        == fit_costs(read_profile(DATA / "plan_roofline_tiny_t1.json")).prefill.coef
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [("not json", "cannot read"), ('{"rows": []}', "no `results`"), ('{"results": []}', "threads")],
)
def test_a_file_that_is_not_a_roofline_json_is_refused(tmp_path, body, needle):
    path = tmp_path / "bad.json"
    path.write_text(body)
    with pytest.raises(PlanError, match=needle):
        read_profile(path)
