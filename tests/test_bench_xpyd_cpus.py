"""`bench serve --xpyd` gives every layout the same cores, each thinker worker its even share as
`runtime.cpus`: P/D layouts, their colocated baselines and colocated-Nx ones, and the CPU counts
it refuses."""

from __future__ import annotations

import argparse
import os

import pytest

from omni_pd.bench import serve
from omni_pd.bench.serve_configs import xpyd_targets
from omni_pd.bench.xpyd_layouts import bench_cpus
from omni_pd.config import load_pipeline_config
from omni_pd.config.cpu_checks import check_host_cpus
from omni_pd.config.replicas import replica_configs
from omni_pd.orchestrator.threads import stage_threads, worker_threads
from omni_pd.paths import STAGE_CONFIGS_DIR

PD = "stage_configs/ci/qwen3_omni_tiny_pd.yaml"
COLOCATED = "stage_configs/ci/qwen3_omni_tiny.yaml"


def _cpus_by_role(path) -> dict[str, tuple]:
    """Each stage's runtime.cpus by role: prefill, decode, thinker (colocated), talker, code2wav."""
    out = {}
    for stage in load_pipeline_config(path).stages:
        role = "prefill" if stage.is_prefill_only else "decode" if stage.is_decode_only else stage.model_stage
        out[role] = stage.runtime.cpus
    return out


def test_1p1d_its_baseline_and_colocated_1x_share_the_same_two_cores(tmp_path):
    made = xpyd_targets("1P1D,colocated-1x", PD, COLOCATED, tmp_path, cpus=(0, 1))
    assert [(t.label, t.baseline) for t in made] == [
        ("colocated-2x", None),
        ("1P1D", "colocated-2x"),
        ("colocated-1x", None),
    ]
    by_label = {t.label: t for t in made}
    assert _cpus_by_role(by_label["1P1D"].config) == {
        "prefill": ((0,),),
        "decode": ((1,),),
        "talker": None,  # the other stages stay unpinned
        "code2wav": None,
    }
    assert _cpus_by_role(by_label["colocated-2x"].config)["thinker"] == ((0,), (1,))
    one = load_pipeline_config(by_label["colocated-1x"].config)
    assert one.stage(0).runtime.cpus == ((0, 1),) and one.stage(0).runtime.num_replicas == 1
    # One thinker on both cores runs two torch threads, where the unpinned share would be one.
    assert worker_threads(one.stage(0), stage_threads(one.stages, cores=2)[0]) == (2, 1)
    assert {t.label: t.cpus for t in made} == {
        "colocated-2x": {"thinker": ["0", "1"]},
        "1P1D": {"prefill": ["0"], "decode": ["1"]},
        "colocated-1x": {"thinker": ["0-1"]},
    }
    if {0, 1} <= os.sched_getaffinity(0):
        for target in made:  # what the started server will check before its workers start
            check_host_cpus(load_pipeline_config(target.config), str(target.config))


def test_2p2d_gives_each_of_its_four_workers_and_its_baselines_a_quarter(tmp_path):
    made = xpyd_targets("2P2D", PD, COLOCATED, tmp_path, cpus=tuple(range(8)))
    pd = {t.label: t for t in made}["2P2D"]
    roles = _cpus_by_role(pd.config)
    assert roles["prefill"] == ((0, 1), (2, 3)) and roles["decode"] == ((4, 5), (6, 7))
    prefill = load_pipeline_config(pd.config).stage(0)
    assert [r.runtime.cpus for r in replica_configs(prefill)] == [((0, 1),), ((2, 3),)]
    baseline = {t.label: t for t in made}["colocated-4x"]
    assert _cpus_by_role(baseline.config)["thinker"] == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_cpus_the_workers_do_not_divide_are_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as fewer:
        xpyd_targets("2P2D", PD, COLOCATED, tmp_path, cpus=(0, 1))
    assert str(fewer.value) == (
        "error: colocated-4x has 4 thinker workers, but --xpyd-cpus gives 2 CPU(s) (0-1): "
        "give at least one CPU per worker"
    )
    with pytest.raises(SystemExit) as uneven:
        xpyd_targets("1P2D", PD, COLOCATED, tmp_path, cpus=(0, 1, 2, 3))
    assert str(uneven.value) == (
        "error: colocated-3x's 3 thinker workers do not share the 4 CPUs of --xpyd-cpus (0-3) "
        "evenly: give a multiple of 3, e.g. --xpyd-cpus 0-2"
    )
    # Negative control: the same layout on three CPUs is accepted.
    assert [t.label for t in xpyd_targets("1P2D", PD, COLOCATED, tmp_path, cpus=(0, 1, 2))] == [
        "colocated-3x",
        "1P2D",
    ]


def test_a_source_config_that_sets_thinker_threads_is_refused(tmp_path):
    source = tmp_path / "threads.yaml"
    source.write_text(
        (STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml")
        .read_text()
        .replace("      process: true\n", "      process: true\n      num_threads: 2\n", 1)
    )
    with pytest.raises(SystemExit, match=r"remove its runtime\.num_threads$"):
        xpyd_targets("colocated-1x", PD, str(source), tmp_path, cpus=(0, 1))
    # --xpyd-cpus none pins nothing, so the file's threads stand and only the replicas change.
    (unpinned,) = xpyd_targets("colocated-1x", PD, str(source), tmp_path, cpus=None)
    thinker = load_pipeline_config(unpinned.config).stage(0).runtime
    assert (thinker.cpus, thinker.num_threads, unpinned.cpus) == (None, 2, {})


def test_the_cpus_flag_defaults_to_this_process_and_refuses_others():
    assert bench_cpus(None) == tuple(sorted(os.sched_getaffinity(0)))
    first = min(os.sched_getaffinity(0))
    assert bench_cpus(str(first)) == (first,)
    with pytest.raises(
        SystemExit, match=r"--xpyd-cpus names CPU\(s\) 4096, which this process may not run on"
    ):
        bench_cpus("0,4096")
    assert bench_cpus("none") is None
    with pytest.raises(SystemExit, match=r"--xpyd-cpus: cannot read 'x'"):
        bench_cpus("x")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_the_run_records_each_targets_cpus_and_refuses_the_flag_without_xpyd(tmp_path):
    targets, baselines, target_cpus = serve._targets(
        _args("--xpyd", "1P1D,colocated-1x", "--xpyd-cpus", "0-1"), tmp_path
    )
    assert [label for label, _ in targets] == ["colocated-2x", "1P1D", "colocated-1x"]
    assert baselines == {"1P1D": "colocated-2x"}
    assert target_cpus["1P1D"] == {"prefill": ["0"], "decode": ["1"]}
    assert target_cpus["colocated-1x"] == {"thinker": ["0-1"]}
    with pytest.raises(SystemExit, match="--xpyd-cpus shares CPUs among the --xpyd layouts; add --xpyd"):
        serve._checked_args(_args("--xpyd-cpus", "0-1"))
