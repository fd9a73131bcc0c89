"""Stage workers run on their `runtime.cpus`: each replica pinned to its own set (every thread of
its process), torch with one thread per CPU of it; a worker whose node lacks its CPUs refuses to
start, naming the stage and the key. This machine has CPUs 0 and 1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from omni_pd.config import ConfigError, load_pipeline_config
from omni_pd.orchestrator.omni import Omni
from omni_pd.orchestrator.stage_client import StageClient, StageError
from omni_pd.paths import STAGE_CONFIGS_DIR
from omni_pd.sampling import SamplingParams

TINY = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"  # 0 thinker, 1 talker, 2 code2wav
SHORT = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), None, None]

pytestmark = pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="pins workers to CPUs 0 and 1, which this process lacks"
)


def _config(tmp_path: Path, **thinker_runtime) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["stage_args"][0]["runtime"].update(thinker_runtime)
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _thread_affinities(pid: int) -> dict[int, set[int]]:
    """The CPUs each thread of process `pid` may run on, read from outside it."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return {tid: os.sched_getaffinity(tid) for tid in tids}


def test_each_replica_runs_every_thread_on_its_own_cpu(tmp_path):
    path = _config(tmp_path, num_replicas=2, cpus=["1", "0"])
    with Omni(stage_configs_path=path) as omni:
        omni.generate(["one prompt", "and another"], SHORT)  # the workers have computed
        clients = omni.engine.pools[0].clients
        for replica, cpu in ((0, 1), (1, 0)):
            info = omni.control(0, "runtime_info", replica=replica)
            assert (info["cpus"], info["num_threads"]) == (str(cpu), 1)
            threads = _thread_affinities(clients[replica].process.pid)
            assert len(threads) > 1 and set(map(frozenset, threads.values())) == {frozenset({cpu})}
        # Negative control: an unpinned stage's worker keeps every CPU of the orchestrator.
        talker = omni.control(1, "runtime_info")
        assert talker["cpus"] == "0-1"


def test_a_worker_takes_one_torch_thread_per_cpu_of_its_set(tmp_path):
    """Two CPUs: two threads, where the default share would be one (2 cores over 3 workers)."""
    with Omni(stage_configs_path=_config(tmp_path, cpus="0-1")) as omni:
        assert omni.control(0, "runtime_info") == {"num_threads": 2, "num_interop_threads": 1, "cpus": "0-1"}
        assert omni.control(1, "runtime_info")["num_threads"] == 1  # unpinned: the share


def test_the_orchestrator_refuses_cpus_this_host_lacks_before_any_worker_starts(tmp_path):
    path = _config(tmp_path, cpus="1,4096")
    with pytest.raises(ConfigError, match=r"stage 0: stage_args\[0\]\.runtime\.cpus: CPU\(s\) 4096 are not"):
        Omni(stage_configs_path=path)


def test_a_worker_whose_node_lacks_its_cpus_refuses_to_start_naming_stage_and_key(tmp_path):
    """What a Ray worker does on its node (the orchestrator cannot see that node's CPUs): the
    same worker start-up, here in a local process given a set past this host's CPUs."""
    stage = load_pipeline_config(_config(tmp_path, cpus="4096")).stage(0)
    client = StageClient(stage, "tiny-qwen3-omni", startup_timeout_s=120)
    try:
        with pytest.raises(StageError) as info:
            client.wait_ready()
    finally:
        client.close()
    message = str(info.value)
    assert "\n" not in message
    assert (
        "failed to start: stage 0: runtime.cpus (stage0): CPU(s) 4096 are not among the CPUs node" in message
    )
    assert "allowed: CPUs within 0-1" in message
