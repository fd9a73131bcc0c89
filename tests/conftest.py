import os
import sys
from pathlib import Path

import pytest
import torch

# One intra-op thread in the test process, as each stage worker gets on this 2-core machine:
# torch's default pool (one thread per core) spins against the workers and other tests.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TINY_CONFIG = REPO / "stage_configs" / "ci" / "qwen3_omni_tiny.yaml"


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip, with one line, where torch sees no CUDA device (CI never has one)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: torch sees none here (scripts/gpu_check.sh "
        "runs the gpu tests where one is lent)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_fault_left_armed():
    """A fault hook a test armed and never reached does not strike the next test."""
    from omni_pd import faults

    yield
    faults.disarm()


@pytest.fixture(scope="session")
def tiny_model():
    from omni_pd.models.qwen3_omni.factory import load_model

    return load_model("tiny-qwen3-omni", "dummy", seed=42)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from omni_pd.models.qwen3_omni.factory import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny-qwen3-omni"))


@pytest.fixture(scope="session")
def python_exe():
    return sys.executable
