#!/usr/bin/env bash
# Set up omni-pd on a fresh machine: system library, virtual env at .venv, pinned packages.
# Idempotent: a second run with unchanged pins only checks a stamp file.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"

# Mooncake's transfer engine links against libibverbs even for TCP transfers.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  echo "setup: installing libibverbs1 (needed by Mooncake's transfer engine)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.omni-pd-setup
want="$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned packages into .venv (a few minutes the first time)"
  # torch 2.13.0+cpu comes from the machine's local wheel folder; never a CUDA build.
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.lock 2>&1 \
    | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -e . 2>&1 \
    | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, transformers, omni_pd; assert torch.__version__.startswith('2.13.0')"
  echo "$want" > "$stamp"
fi
