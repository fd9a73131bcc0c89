"""Build and load C kernels with the system compiler.

A kernel (`NativeKernel`: a name, its C source, and the setting that runs without it) lives beside
the code that calls it: the engines' decode attention in omni_pd/engines/hf/native/, a model's own
kernels in its package. It is compiled for the CPU level torch dispatches to (`target`: AVX-512,
AVX2 or the x86-64 baseline, following `ATEN_CPU_CAPABILITY`), once per source, compiler flags and
CPU, into a cache folder
(`$OMNI_PD_CACHE_DIR`, else `~/.cache/omni-pd`), and loaded with ctypes; no torch headers, so a
build takes well under a second. `scripts/setup.sh` builds every kernel ahead (`python -m
omni_pd.engines.hf.build_kernels`); a process that finds no build makes one, written to a temporary file and renamed into place, so workers
starting together do not trip over each other.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .compute_identity import cpu_capability

SOURCES = Path(__file__).resolve().parent / "native"
# Contraction off: every lane's arithmetic is plain IEEE, which the kernels' length invariance
# rests on. The -march flag comes from `target` (the cache key includes it).
FLAGS = ("-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC")
LIBS = ("-lm",)  # expf, erff, sinf, cosf
# x86-64 micro-architecture levels for torch's CPU levels: v4 has AVX-512 (F, BW, CD, DQ, VL), v3
# AVX2 and FMA. Tuned for this CPU; tuning changes instruction choice, never results.
_X86_MARCH = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "default": "x86-64"}


@dataclass(frozen=True)
class NativeKernel:
    name: str
    source: Path  # the C file
    # What a deployer sets to run without the kernel (torch ops instead), named in build errors.
    fallback: str


# The values of a stage's `*_kernels` key: omni-pd's C kernels, or the same layers on torch ops.
KERNELS = ("native", "torch")


class NativeBuildError(RuntimeError):
    pass


def check_choice(kernels: str, key: str) -> str:
    """`kernels` if it names one of KERNELS, else the error naming the key and its values."""
    if kernels not in KERNELS:
        raise ValueError(f"{key} must be one of {', '.join(KERNELS)}, not {kernels!r}")
    return kernels


def target() -> tuple[str, tuple[str, ...]]:
    """(name, compiler flags) of the level the kernels are built for: on x86-64, torch's CPU
    level in this process; elsewhere this CPU."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        level = cpu_capability()
        return level, (f"-march={_X86_MARCH[level]}", "-mtune=native")
    return "native", ("-march=native",)


def cache_dir() -> Path:
    root = os.environ.get("OMNI_PD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "omni-pd"


def _compiler(kernel: NativeKernel) -> str:
    for compiler in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if compiler and shutil.which(compiler):
            return compiler
    raise NativeBuildError(
        f"no C compiler found for the {kernel.name} kernels (tried $CC, cc, gcc, "
        "clang): install one (Debian/Ubuntu: `apt-get install gcc`; "
        f"scripts/setup.sh does), or set {kernel.fallback}"
    )


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))) or platform.machine()


def library_path(kernel: NativeKernel) -> Path:
    name, flags = target()
    digest = xxhash.xxh3_64()
    for part in (
        kernel.source.read_bytes(),
        " ".join(FLAGS + flags + LIBS).encode(),
        _cpu_id().encode(),
        platform.machine().encode(),
    ):
        digest.update(part)
    return cache_dir() / "kernels" / f"{kernel.name}-{name}-{digest.hexdigest()}.so"


def build_id(kernel: NativeKernel) -> str:
    """What names this process's build of `kernel` (its target and source/flags digest): two
    processes with the same id compute with the same machine code."""
    return library_path(kernel).stem.removeprefix(f"{kernel.name}-")


def build(kernel: NativeKernel) -> Path:
    """The compiled library for `kernel`, building it if this machine has none yet."""
    path = library_path(kernel)
    if path.is_file():
        return path
    compiler = _compiler(kernel)
    name, flags = target()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    command = [compiler, *FLAGS, *flags, str(kernel.source), "-o", partial, *LIBS]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildError(
                f"building the {kernel.name} kernels for {name} failed "
                f"({' '.join(command)}):\n{done.stderr.strip()}\nfix the "
                f"compiler setup, set ATEN_CPU_CAPABILITY to a level this "
                f"compiler can target, or set {kernel.fallback}"
            )
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def load(kernel: NativeKernel) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(kernel)))
