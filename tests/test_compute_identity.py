"""The compute identity: torch's CPU level, checked by name; native kernels built per level."""

import os
import subprocess
import sys

import pytest
import torch

from omni_pd.engines.hf import native_build
from omni_pd.engines.hf.attention_native import ATTENTION, native_builds
from omni_pd.engines.hf.experts_native import EXPERTS
from omni_pd.engines.hf.compute_identity import (
    CpuCapabilityError,
    check_capability_value,
    compute_identity,
    cpu_capability,
    known_levels,
)

HOST = torch.backends.cpu.get_cpu_capability().lower()
x86 = pytest.mark.skipif(known_levels() != ("default", "avx2", "avx512"), reason="x86-64 levels")


def _in_subprocess(code: str, capability: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_identity_names_device_torch_level_and_builds():
    identity = compute_identity("cpu", native_builds("native"))
    assert identity == {
        "device": "cpu",
        "torch": torch.__version__,
        "cpu_capability": cpu_capability(),
        "native": {"attention": native_build.build_id(ATTENTION), "experts": native_build.build_id(EXPERTS)},
    }
    assert compute_identity("cpu", native_builds("torch"))["native"] == {}


def test_an_unknown_value_is_refused_naming_it_and_the_choices():
    with pytest.raises(CpuCapabilityError, match=r"ATEN_CPU_CAPABILITY='AVX2' is not .*use one of default"):
        check_capability_value("AVX2")
    done = _in_subprocess(
        "from omni_pd.engines.hf.compute_identity import cpu_capability; cpu_capability()", "bogus"
    )
    assert done.returncode != 0 and "ATEN_CPU_CAPABILITY='bogus'" in done.stderr, done.stderr[-2000:]


@x86
def test_a_level_above_this_cpu_is_refused():
    if HOST == "avx512":
        pytest.skip("this CPU runs every x86-64 level torch has")
    done = _in_subprocess(
        "from omni_pd.engines.hf.compute_identity import cpu_capability; cpu_capability()", "avx512"
    )
    assert done.returncode != 0 and f"torch computes with '{HOST}'" in done.stderr, done.stderr[-2000:]


@x86
def test_native_kernels_are_built_per_level():
    """Told to compute as an older CPU, a process builds (and names) its C kernels for that
    level too: the build id, and so the compute identity, differ."""
    code = (
        "from omni_pd.engines.hf import native_build as nb; from omni_pd.engines.hf.attention_native "
        "import ATTENTION; nb.build(ATTENTION); print(nb.build_id(ATTENTION))"
    )
    ids = {}
    for level in ("default", "avx2") + (("avx512",) if HOST == "avx512" else ()):
        done = _in_subprocess(code, level)
        assert done.returncode == 0, done.stderr[-2000:]
        ids[level] = done.stdout.strip()
        assert ids[level].startswith(f"{level}-")
    assert len(set(ids.values())) == len(ids)
