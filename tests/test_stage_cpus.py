"""`runtime.cpus`: the forms the YAML takes, each worker's set and threads, and every refusal as
one line naming the stage and the key."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from omni_pd.config import ConfigError, PipelineConfig, load_deploy_config, pipeline_config_from_dict
from omni_pd.config.cpu_checks import check_host_cpus
from omni_pd.config.cpus import format_cpulist, parse_cpulist
from omni_pd.config.replicas import replica_configs
from omni_pd.orchestrator.threads import stage_threads, worker_threads
from omni_pd.paths import STAGE_CONFIGS_DIR

PD = yaml.safe_load((STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml").read_text())


def _pd(**runtimes: dict[str, Any]) -> dict[str, Any]:
    """The tiny P/D pipeline (0 prefill, 1 decode, 2 talker, 3 code2wav) with runtime keys set
    per stage: _pd(s0={"cpus": "0"})."""
    data = copy.deepcopy(PD)
    for name, keys in runtimes.items():
        data["stage_args"][int(name[1:])]["runtime"].update(keys)
    return data


def _load(data: dict[str, Any]) -> PipelineConfig:
    return pipeline_config_from_dict(data, file="pd.yaml", check_imports=False)


def _only_issue(data: dict[str, Any]):
    with pytest.raises(ConfigError) as info:
        _load(data)
    assert len(info.value.issues) == 1, str(info.value)
    issue = info.value.issues[0]
    assert "\n" not in str(issue)  # one line
    return issue


def test_cpulists_read_and_print_as_the_kernel_writes_them():
    assert parse_cpulist("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpulist(" 5 , 1-2,2") == (1, 2, 5)
    assert format_cpulist([6, 0, 1, 2, 3]) == "0-3,6"
    assert format_cpulist([1, 3, 5]) == "1,3,5"


@pytest.mark.parametrize(
    ("written", "sets"),
    [
        ("0-3,6", ((0, 1, 2, 3, 6),)),
        (2, ((2,),)),
        ([1, 0], ((0, 1),)),  # a list of numbers is one set
        (["0-1"], ((0, 1),)),
    ],
)
def test_one_worker_takes_one_set_in_any_form(written, sets):
    stage = _load(_pd(s0={"cpus": written})).stage(0)
    assert stage.runtime.cpus == sets
    # Its threads: one per CPU of the set, unless num_threads says fewer.
    assert worker_threads(stage, (7, 1)) == (len(sets[0]), 1)


def test_replicas_take_one_set_each_and_as_many_threads():
    data = _pd(s0={"num_replicas": 2, "cpus": ["2-3", [0]]}, s1={"cpus": "4-5", "num_threads": 1})
    config = _load(data)
    replicas = replica_configs(config.stage(0))
    assert [r.runtime.cpus for r in replicas] == [((2, 3),), ((0,),)]
    shares = stage_threads(config.stages, cores=16)  # 5 workers: 3 threads each unless pinned
    assert [worker_threads(r, shares[0]) for r in replicas] == [(2, 1), (1, 1)]
    assert worker_threads(config.stage(1), shares[1]) == (1, 1)  # num_threads given: kept
    assert worker_threads(config.stage(2), shares[2]) == (3, 1)  # not pinned: the stage's share


@pytest.mark.parametrize(
    ("written", "says"),
    [
        ("", "names no CPU"),
        ([], "names no CPU"),
        ("3-1", "runs backwards; write 1-3"),
        ("0-x", "cannot read '0-x'"),
        ([0, "1"], "mixes CPU numbers with sets"),
        ([-1], "-1 is not a CPU number"),
        (True, "expected a cpulist"),
    ],
)
def test_an_unreadable_or_empty_set_is_refused_by_stage_and_key(written, says):
    issue = _only_issue(_pd(s1={"cpus": written}))
    assert (issue.stage_id, issue.key) == (1, "stage_args[1].runtime.cpus")
    assert says in issue.message


def test_an_empty_set_of_one_replica_names_the_replica():
    issue = _only_issue(_pd(s0={"num_replicas": 2, "cpus": ["0", ""]}))
    assert (issue.stage_id, issue.key) == (0, "stage_args[0].runtime.cpus")
    assert "replica 1's set" in issue.message and "names no CPU" in issue.message


def test_a_cpu_two_stages_share_is_refused_at_the_later_one():
    issue = _only_issue(_pd(s0={"cpus": "0-1"}, s2={"cpus": "1-2"}))
    assert (issue.stage_id, issue.key) == (2, "stage_args[2].runtime.cpus")
    assert "stage 2 shares CPU(s) 1 with stage 0" in issue.message
    assert issue.allowed == "CPUs no other worker is pinned to"


def test_a_cpu_two_replicas_share_is_refused_naming_both():
    issue = _only_issue(_pd(s1={"num_replicas": 2, "cpus": ["0-1", "1"]}))
    assert (issue.stage_id, issue.key) == (1, "stage_args[1].runtime.cpus[1]")
    assert "stage 1 replica 1 shares CPU(s) 1 with stage 1 replica 0" in issue.message


def test_ray_workers_may_reuse_cpu_numbers_since_they_may_sit_on_other_nodes():
    ray = {"distributed_executor_backend": "ray"}
    data = _pd(s0={"cpus": "0"}, s1={"cpus": "0"})
    for stage in data["stage_args"][:2]:
        stage["engine_args"].update(ray)
    assert _load(data).stage(1).runtime.cpus == ((0,),)
    # Negative control: the same sets on local workers collide.
    assert "shares CPU(s) 0 with stage 0" in _only_issue(_pd(s0={"cpus": "0"}, s1={"cpus": "0"})).message


def test_one_set_for_two_replicas_is_refused_with_the_set_split_as_the_fix():
    issue = _only_issue(_pd(s0={"num_replicas": 2, "cpus": "0-3"}))
    assert (issue.stage_id, issue.key) == (0, "stage_args[0].runtime.cpus")
    assert "1 CPU set for 2 workers (num_replicas: 2)" in issue.message
    assert issue.allowed == 'one set per replica, e.g. cpus: ["0-1", "2-3"]'


def test_two_sets_for_one_worker_are_refused():
    issue = _only_issue(_pd(s3={"cpus": ["0", "1"]}))
    assert (issue.stage_id, issue.key) == (3, "stage_args[3].runtime.cpus")
    assert "2 CPU sets for 1 worker" in issue.message
    assert issue.allowed == 'one set, e.g. cpus: "0-1", or num_replicas: 2'


def test_an_in_process_stage_cannot_be_pinned():
    issue = _only_issue(_pd(s2={"cpus": "0", "process": False}))
    assert (issue.stage_id, issue.key) == (2, "stage_args[2].runtime.cpus")
    assert "runtime.process: false" in issue.message
    assert issue.allowed == "runtime.process: true, or remove runtime.cpus"


def test_tensor_parallel_ranks_are_not_shared_a_set():
    data = _pd(s1={"cpus": "0-3"})
    data["stage_args"][1]["engine_args"].update(engine="vllm", tensor_parallel_size=2)
    for key in ("kv_block_size", "kv_pool_blocks"):  # hf-only keys, refused on vllm otherwise
        data["stage_args"][1]["engine_args"].pop(key)
    with pytest.raises(ConfigError) as info:
        _load(data)
    cpus_issues = [i for i in info.value.issues if i.key.endswith("runtime.cpus")]
    assert len(cpus_issues) == 1 and cpus_issues[0].stage_id == 1
    assert "tensor_parallel_size 2 runs a process per rank" in cpus_issues[0].message


def test_more_threads_than_cpus_are_refused_at_num_threads():
    issue = _only_issue(_pd(s0={"num_replicas": 2, "cpus": ["0-2", "3"], "num_threads": 2}))
    assert (issue.stage_id, issue.key) == (0, "stage_args[0].runtime.num_threads")
    assert "2 threads on the 1 CPU(s) 3 of runtime.cpus" in issue.message
    assert _load(_pd(s0={"cpus": "0-1", "num_threads": 2})).stage(0).runtime.num_threads == 2


def test_cpus_this_host_lacks_are_refused_before_any_worker_starts():
    config = _load(_pd(s0={"cpus": "0"}, s1={"num_replicas": 2, "cpus": ["1", "2-3"]}))
    check_host_cpus(config, "pd.yaml", available={0, 1, 2, 3})  # all there: nothing raised
    with pytest.raises(ConfigError) as info:
        check_host_cpus(config, "pd.yaml", available={0, 1})
    (issue,) = info.value.issues
    assert (issue.stage_id, issue.key) == (1, "stage_args[1].runtime.cpus[1]")
    assert "CPU(s) 2-3 are not among the CPUs this host lets this process run on (0-1" in issue.message
    assert issue.allowed == "CPUs within 0-1"


def test_the_host_check_reads_this_process_affinity_and_leaves_ray_stages_to_their_node():
    data = _pd(s0={"cpus": "4096"})
    config = _load(data)
    with pytest.raises(ConfigError, match=r"stage 0: stage_args\[0\]\.runtime\.cpus: CPU\(s\) 4096"):
        check_host_cpus(config, "pd.yaml")
    data["stage_args"][0]["engine_args"]["distributed_executor_backend"] = "ray"
    check_host_cpus(_load(data), "pd.yaml")  # its node checks it (test_cpu_pin.py)


def test_a_deploy_file_sets_cpus_under_a_stages_runtime_and_is_refused_by_its_own_keys(tmp_path):
    raw = yaml.safe_load((STAGE_CONFIGS_DIR / "deploy" / "qwen3_omni_tiny_pd.yaml").read_text())
    stages = {s["stage_id"]: s for s in raw["stages"]}
    stages[0].update(num_replicas=2, runtime={"cpus": ["0", "1"]})
    stages[1]["runtime"] = {"cpus": "2"}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert [s.runtime.cpus for s in load_deploy_config(path, check_imports=False).stages][:2] == [
        ((0,), (1,)),
        ((2,),),
    ]
    stages[1]["runtime"] = {"cpus": "1"}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path, check_imports=False)
    (issue,) = info.value.issues
    assert (issue.stage_id, issue.key) == (1, "stages[stage_id=1].runtime.cpus")
    assert "stage 1 shares CPU(s) 1 with stage 0 replica 1" in issue.message
