"""Build and load C kernels with the system compiler.

A kernel (`NativeKernel`: a name, its C source, and the setting that runs without it) lives beside
the code that calls it: the engines' decode attention in omni_pd/engines/hf/native/, a model's own
kernels in its package. It is compiled once per source, compiler flags and CPU into a cache folder
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

SOURCES = Path(__file__).resolve().parent / "native"
# -march=native: the build is for this CPU (the cache key includes it). Contraction off: every
# lane's arithmetic is plain IEEE, which the kernels' length invariance rests on.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC")
LIBS = ("-lm",)  # expf, erff, sinf, cosf


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


def cache_dir() -> Path:
    root = os.environ.get("OMNI_PD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "omni-pd"


def _compiler(kernel: NativeKernel) -> str:
    for compiler in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if compiler and shutil.which(compiler):
            return compiler
    raise NativeBuildError(f"no C compiler found for the {kernel.name} kernels (tried $CC, cc, gcc, "
                           "clang): install one (Debian/Ubuntu: `apt-get install gcc`; "
                           f"scripts/setup.sh does), or set {kernel.fallback}")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))) or platform.machine()


def library_path(kernel: NativeKernel) -> Path:
    digest = xxhash.xxh3_64()
    for part in (kernel.source.read_bytes(), " ".join(FLAGS + LIBS).encode(), _cpu_id().encode(),
                 platform.machine().encode()):
        digest.update(part)
    return cache_dir() / "kernels" / f"{kernel.name}-{digest.hexdigest()}.so"


def build(kernel: NativeKernel) -> Path:
    """The compiled library for `kernel`, building it if this machine has none yet."""
    path = library_path(kernel)
    if path.is_file():
        return path
    compiler = _compiler(kernel)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    command = [compiler, *FLAGS, str(kernel.source), "-o", partial, *LIBS]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildError(f"building the {kernel.name} kernels failed "
                                   f"({' '.join(command)}):\n{done.stderr.strip()}\nfix the "
                                   f"compiler setup, or set {kernel.fallback}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def load(kernel: NativeKernel) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(kernel)))
