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
  $(pins 'aiohttp|aiohappyeyeballs|aiosignal|attrs|frozenlist|multidict|propcache|yarl|pydantic|pydantic_core|annotated-types|typing-inspection|fastapi|starlette|annotated-doc|uvicorn|h11|openai|httpx2|httpcore2|truststore|anyio|idna|jiter|distro|sniffio|soundfile|cffi|pycparser|websockets|webrtcvad-wheels|soxr|transformers')
  mooncake-transfer-engine-cuda13==0.3.14
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl "${wanted[@]}"
# The device tool carries at most 64 MiB with the tree. Mooncake's wheel is 50 MB, most of it the
# store, the process-group backend and their binaries, which omni-pd never imports (it uses
# mooncake.engine alone): keep the wheel's transfer-engine files only, its RECORD trimmed to match.
"$(command -v python3)" - <<'PY'
import glob, zipfile, os
drop = ("mooncake/_store.", "mooncake/_ep.", "mooncake/mooncake_client", "mooncake/mooncake_master",
        "mooncake/transfer_engine_bench", "mooncake/libmooncake_pg", "mooncake/libmooncake_ep",
        "mooncake_transfer_engine_cuda13.libs/libetcd_wrapper-")
for path in glob.glob(".whl/mooncake_transfer_engine_cuda13-*.whl"):
    slim = path + ".slim"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(l for l in lines if not l.startswith(drop)) + "\n").encode()
            dst.writestr(info, data)
    os.replace(slim, path)
PY
# The GPU image already has huggingface_hub and tokenizers in versions transformers 5.19 accepts.
rm -f .whl/huggingface_hub-*.whl .whl/tokenizers-*.whl
ls -1 .whl
du -sh .whl
