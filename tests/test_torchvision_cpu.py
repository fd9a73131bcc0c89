"""torchvision imports under the CPU torch in every process of the venv (the .pth hook of
omni_pd/engines/vllm/torchvision_cpu.py), and without the hook it does not: the reason vLLM's
Qwen3-Omni thinker could not import here. Each check runs in a fresh interpreter, as vLLM's own
subprocesses do."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from vllm_required import require_vllm

require_vllm()


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_venv_arms_the_hook_at_every_start():
    pth = Path(sysconfig.get_paths()["purelib"]) / "omni_pd_torchvision_cpu.pth"
    assert pth.read_text().strip() == "import omni_pd.engines.vllm.torchvision_cpu"
    done = _python(
        "import sys; print(any(type(f).__name__ == '_BeforeTorchvision' "
        "for f in sys.meta_path), 'torch' in sys.modules)"
    )
    assert done.stdout.split() == ["True", "False"]  # armed, and torch not imported for it


def test_torchvision_and_the_omni_thinker_import():
    done = _python(
        "import torchvision\n"
        "from vllm.model_executor.models.qwen3_omni_moe_thinker import "
        "Qwen3OmniMoeThinkerForConditionalGeneration\n"
        "from omni_pd.engines.vllm import torchvision_cpu as t\n"
        "print(t._library is not None)"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"  # defined here: the CUDA build's ops do not load


def test_negative_control_without_the_hook_torchvision_does_not_import():
    done = _python("from omni_pd.engines.vllm import torchvision_cpu as t\nt.uninstall()\nimport torchvision")
    assert done.returncode != 0
    assert "torchvision::nms does not exist" in done.stderr


def test_where_the_compiled_ops_load_nothing_is_defined():
    done = _python(
        "from omni_pd.engines.vllm import torchvision_cpu as t\n"
        "t.uninstall()\n"
        "t.compiled_ops_load = lambda package_dir: True\n"
        "print(t.define_missing_ops(), t._library)"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "None"]
