"""What an hf stage computes with: torch's CPU dispatch level, the native kernels' build, the device.

Two engines that load the same weights still produce different bits where their kernels differ:
torch picks its CPU kernels by instruction set at run time (AVX-512, AVX2 or the baseline), and
`ATEN_CPU_CAPABILITY` forces a lower level. Exactness (a request's bits do not depend on its
batch; P/D equals colocated) is proven per kernel set, so the set is named:

* `cpu_capability()` is the level torch dispatches to in this process. An `ATEN_CPU_CAPABILITY`
  that torch does not know, or that this CPU cannot run, is refused here by name (torch itself
  warns and quietly takes the host's best).
* The native C kernels are built for the same level (`native_build.target`), so a process told
  to compute as an AVX2 host does so in C too, and the build's id says which.
* `compute_identity` goes into the KV fingerprint: a prefill and a decode engine whose identities
  differ hand over KV that the decode engine would not have computed itself (kv/fingerprint.py).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

ENV = "ATEN_CPU_CAPABILITY"
# The values torch 2.13 accepts, per machine (aten/src/ATen/native/DispatchStub.cpp).
_LEVELS = {
    "x86_64": ("default", "avx2", "avx512"),
    "aarch64": ("default", "sve256"),
    "ppc64le": ("default", "vsx"),
    "s390x": ("default", "zvector"),
}


class CpuCapabilityError(ValueError):
    """`ATEN_CPU_CAPABILITY` names a level torch does not know or this CPU cannot run."""


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def known_levels() -> tuple[str, ...]:
    return _LEVELS.get(_machine(), ("default",))


def check_capability_value(value: str, where: str = ENV) -> str:
    """`value` if torch knows it on this machine, else the error naming it and the choices."""
    levels = known_levels()
    if value not in levels:
        raise CpuCapabilityError(
            f"{where}={value!r} is not a CPU capability torch knows on {_machine()}: use one of "
            f"{', '.join(levels)} (lower case), or leave it unset for this CPU's best"
        )
    return value


def cpu_capability() -> str:
    """The level torch's CPU kernels dispatch to in this process, lower case ('avx512', 'avx2',
    'default', ...), after checking `ATEN_CPU_CAPABILITY` against it."""
    requested = os.environ.get(ENV)
    if requested is not None and requested != "":
        check_capability_value(requested)
    effective = torch.backends.cpu.get_cpu_capability().lower()
    if requested and requested != effective:
        raise CpuCapabilityError(
            f"{ENV}={requested!r} but torch computes with {effective!r} in this process: this CPU "
            f"cannot run {requested!r}, or torch chose its kernels before the variable was set "
            "(a stage that runs inside the orchestrator's process shares its torch: give it "
            f"runtime.process: true). Use one of {', '.join(_supported(effective))}"
        )
    return effective


def _supported(effective: str) -> list[str]:
    levels = known_levels()
    return list(levels[: levels.index(effective) + 1]) if effective in levels else [effective]


def device_identity(device: torch.device | str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuda {torch.cuda.get_device_name(dev)} sm_{major}{minor}"
    return dev.type


def compute_identity(device: torch.device | str, native_builds: dict[str, str]) -> dict[str, Any]:
    """Plain data for the KV fingerprint: the device, torch's version and CPU level, and the id
    of each native kernel build the engine computes with ({} when it uses torch's kernels)."""
    return {
        "device": device_identity(device),
        "torch": torch.__version__,
        "cpu_capability": cpu_capability(),
        "native": dict(sorted(native_builds.items())),
    }


def older_level() -> str | None:
    """The level just below the one torch runs at here ('avx2' on an AVX-512 host), or None."""
    levels = known_levels()
    current = torch.backends.cpu.get_cpu_capability().lower()
    if current not in levels or levels.index(current) == 0:
        return None
    return levels[levels.index(current) - 1]


if __name__ == "__main__":  # `python -m omni_pd.engines.hf.compute_identity --older` (scripts/test.sh)
    import sys

    if sys.argv[1:] != ["--older"]:
        sys.exit("usage: python -m omni_pd.engines.hf.compute_identity --older")
    print(older_level() or "")
