"""Stage workers as Ray actors on a real two-node Ray cluster (two raylets on this machine, Ray's
own test utility): prefill on one node, decode on the other, placed by Ray resources, the KV over
Mooncake tcp between them (the same-host path off). Outputs equal the colocated pipeline's; a
killed actor is restarted, its request fails naming the stage, and nothing leaks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omni_pd.orchestrator.omni import Omni
from omni_pd.orchestrator.stage_client import StageError
from omni_pd.paths import STAGE_CONFIGS_DIR

from live_server import wait_for
from test_pd_equivalence import _prompts, alone, colocated, colocated_config, differences  # noqa: F401

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (OMNI_PD_RAY=1 setup)")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow
PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
PREFILL, DECODE, TALKER = 0, 1, 2


def ray_config(path: Path, *, same_host: str = "off") -> Path:
    """The tiny P/D pipeline with every stage a Ray actor: prefill on the node labelled
    prefill_node, decode on decode_node, the rest wherever Ray puts them."""
    raw = yaml.safe_load(PD.read_text())
    for stage in raw["stage_args"]:
        stage["engine_args"]["distributed_executor_backend"] = "ray"
        kv = stage["engine_args"].get("kv_transfer_config")
        if kv:
            kv["kv_connector_extra_config"]["kv_same_host"] = same_host
    raw["stage_args"][PREFILL]["runtime"]["ray_resources"] = {"prefill_node": 1}
    raw["stage_args"][DECODE]["runtime"]["ray_resources"] = {"decode_node": 1}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def cluster():
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"prefill_node": 1}})
    nodes.add_node(num_cpus=2, resources={"decode_node": 1})
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = nodes.address
    yield nodes
    if before is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = before
    ray.shutdown()  # the driver leaves the cluster before its nodes go
    nodes.shutdown()


@pytest.fixture(scope="module")
def on_ray(cluster, tmp_path_factory):
    path = ray_config(tmp_path_factory.mktemp("ray") / "ray_pd.yaml")
    with Omni(stage_configs_path=path, keep_stage_outputs=True) as omni:
        yield omni


@pytest.fixture(autouse=True)
def nothing_left(request):
    yield
    if "on_ray" in request.fixturenames:
        omni = request.getfixturevalue("on_ray")
        wait_for(lambda: omni.health()["status"] == "ok", 60, "every actor up again")
        counts = omni.debug_state_counts()
        assert all(v == 0 for v in counts.values()), counts


def test_prefill_and_decode_actors_sit_on_different_nodes_by_their_resources(cluster, on_ray):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    prefill = on_ray.clients[PREFILL].process
    decode = on_ray.clients[DECODE].process
    assert prefill.node_id != decode.node_id
    assert "prefill_node" in nodes[prefill.node_id] and "decode_node" in nodes[decode.node_id]


@pytest.mark.parametrize("case", ["over_one_block", "audio"])
def test_pd_across_nodes_equals_colocated(colocated, on_ray, case):
    want = alone(colocated, "colocated", case)
    got = on_ray.generate([_prompts(on_ray)[case]])[0]
    assert differences(colocated, want, on_ray, got) == []
    # The KV crossed between the nodes over Mooncake, not by shared memory, and all of it.
    assert got.metrics["kv_path"] == "tcp" and not got.metrics["kv_fallback"]
    assert got.metrics["num_cached_prompt_tokens"] == len(got.prompt_token_ids)


def test_negative_control_another_prompt_differs(colocated, on_ray):
    want = alone(colocated, "colocated", "over_one_block")
    got = on_ray.generate([_prompts(on_ray)["short"]])[0]
    assert differences(colocated, want, on_ray, got) != []


def test_a_killed_actor_fails_its_request_naming_the_stage_and_is_restarted(on_ray):
    talker = on_ray.clients[TALKER]
    actor, pid = talker.process.actor, talker.process.pid
    killed = []

    def on_chunk_kill(*_):  # the moment the request's audio has started: kill the talker
        if not killed:
            killed.append(True)
            ray.kill(actor, no_restart=True)

    with pytest.raises(StageError, match=r"stage 2 \(talker\).*Ray actor"):
        for _ in on_ray.audio_chunks(_prompts(on_ray)["long_1000"]):
            on_chunk_kill()
    wait_for(
        lambda: talker.process.pid not in (None, pid) and on_ray.health()["status"] == "ok",
        60,
        "a new talker actor",
    )
    assert talker.restarts >= 1
    out = on_ray.generate([_prompts(on_ray)["short"]])[0]
    assert out.audio is not None and out.audio.numel() > 0


def test_an_unreachable_cluster_is_a_clear_error_at_start(tmp_path):
    """A fresh process (this one is already on a cluster): no hang, one message naming the
    address and what to do."""
    path = ray_config(tmp_path / "ray_pd.yaml")
    code = f"from omni_pd.orchestrator.omni import Omni\nOmni(stage_configs_path={str(path)!r})\n"
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}  # the discard port: nothing listens
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "RayUnavailable: no Ray cluster answers at RAY_ADDRESS=127.0.0.1:9" in last, done.stderr
    assert "ray start --head" in last
