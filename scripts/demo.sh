#!/usr/bin/env bash
# The main job: the embedded tiny Qwen3-Omni through every stage, on the CPU. Prints the text and
# timings and writes out.wav. Extra arguments go to `omni-pd generate`.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
exec .venv/bin/omni-pd generate --prompt "${PROMPT:-Tell me something about the sea.}" \
  --output "${OUTPUT:-out.wav}" "$@"
