#!/usr/bin/env bash
# Run HERE (a machine with PyPI), before scripts/gpu_check.sh on a GPU host that has no network:
# downloads into .whl/ the wheels that host lacks (its image has torch, transformers, numpy,
# safetensors, xxhash, pyyaml, prometheus-client, tqdm, matplotlib and pytest, not these), for
# Python 3.12 on x86-64. .whl/ is git-ignored; carry it (the device tool's `carry: [".whl"]`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins() { grep -iE "^($1)==" requirements.lock; }
wanted=(
  $(pins 'pydantic|pydantic_core|annotated-types|typing-inspection|fastapi|starlette|annotated-doc|uvicorn|h11|openai|jiter|distro|sniffio|soundfile|cffi|pycparser|websockets|webrtcvad-wheels|transformers|huggingface_hub|tokenizers')
  mooncake-transfer-engine-cuda13==0.3.14
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl "${wanted[@]}"
ls -1 .whl
du -sh .whl
