"""Build and load omni-pd's C kernels (omni_pd/engines/hf/native/*.c) with the system compiler.

A kernel is compiled once per source, compiler flags and CPU into a cache folder
(`$OMNI_PD_CACHE_DIR`, else `~/.cache/omni-pd`), and loaded with ctypes; no torch headers, so a
build takes well under a second. `scripts/setup.sh` builds them ahead (`python -m
omni_pd.engines.hf.native_build`); a process that finds no build makes one, written to a temporary
file and renamed into place, so workers starting together do not trip over each other.
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import xxhash

SOURCES = Path(__file__).resolve().parent / "native"
# -march=native: the build is for this CPU (the cache key includes it). Contraction off: every
# lane's arithmetic is plain IEEE, which the kernels' length invariance rests on.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC")
LIBS = ("-lm",)  # expf, erff, sinf, cosf


# What a deployer sets to run without a kernel (torch ops instead), named in build errors.
FALLBACK = {
    "code2wav": "the code2wav stage's engine_args.code2wav_kernels: torch",
    "attention": "the thinker and talker stages' engine_args.attention_kernels: torch",
}


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


def _compiler(name: str) -> str:
    for compiler in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if compiler and shutil.which(compiler):
            return compiler
    raise NativeBuildError(f"no C compiler found for the {name} kernels (tried $CC, cc, gcc, "
                           "clang): install one (Debian/Ubuntu: `apt-get install gcc`; "
                           f"scripts/setup.sh does), or set {FALLBACK[name]}")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))) or platform.machine()


def library_path(name: str) -> Path:
    source = SOURCES / f"{name}.c"
    digest = xxhash.xxh3_64()
    for part in (source.read_bytes(), " ".join(FLAGS + LIBS).encode(), _cpu_id().encode(),
                 platform.machine().encode()):
        digest.update(part)
    return cache_dir() / "kernels" / f"{name}-{digest.hexdigest()}.so"


def build(name: str) -> Path:
    """The compiled library for kernel `name`, building it if this machine has none yet."""
    path = library_path(name)
    if path.is_file():
        return path
    compiler = _compiler(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    command = [compiler, *FLAGS, str(SOURCES / f"{name}.c"), "-o", partial, *LIBS]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildError(f"building the {name} kernels failed ({' '.join(command)}):\n"
                                   f"{done.stderr.strip()}\nfix the compiler setup, or set "
                                   f"{FALLBACK[name]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def load(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(name)))


if __name__ == "__main__":
    for source in sorted(SOURCES.glob("*.c")):
        print(build(source.stem))
    sys.exit(0)
