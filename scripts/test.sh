#!/usr/bin/env bash
# The test suite, end-to-end tests included, vLLM and Ray tests too (the setup installs both extras).
# Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
OMNI_PD_VLLM=1 OMNI_PD_RAY=1 bash "$repo/scripts/setup.sh"
cd "$repo"
export MC_LOG_LEVEL="${MC_LOG_LEVEL:-ERROR}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
