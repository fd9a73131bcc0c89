#!/usr/bin/env bash
# Lint and types first (ruff check, ruff format --check, mypy on the generic layers: pyproject.toml
# configures all three), the docs site (mkdocs build --strict into a temporary folder: a broken
# link or anchor, or a page missing from mkdocs.yml's nav, fails it), then the test suite,
# end-to-end tests included, vLLM and Ray tests too (the setup installs both extras, the checkers
# and the docs builder), and the demo page's test in headless Chromium (the setup installs
# Debian's chromium).
# Then the exactness suites (pytest -m exactness) a second time with torch dispatching to an older
# CPU level than the host's best (ATEN_CPU_CAPABILITY: avx2 on an AVX-512 host, the x86-64 baseline
# on an AVX2 host), so that one host checks the bits of both kinds of CI host. Extra arguments go to
# both pytest runs; OMNI_PD_SECOND_ISA=0 skips the second, OMNI_PD_LINT=0 the checks. Where the CPU has
# bfloat16 arithmetic, the P/D equivalence and prefix-cache suites run a third time in bfloat16
# (OMNI_PD_BF16=0 skips it).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
OMNI_PD_VLLM=1 OMNI_PD_RAY=1 OMNI_PD_BROWSER=1 OMNI_PD_DEV=1 bash "$repo/scripts/setup.sh"
cd "$repo"
if [ "${OMNI_PD_LINT:-1}" = "1" ]; then
  echo "test.sh: ruff check, ruff format --check, mypy, mkdocs build --strict"
  .venv/bin/ruff check omni_pd tests e2e scripts examples
  .venv/bin/ruff format --check omni_pd tests e2e scripts examples
  # mypy's cache outside the clone (like pip's and the C kernels'): a cold run reads torch's and
  # transformers' types for ~70-100 s on 2 cores, a warm one ~3 s. mypy revalidates every entry
  # by the source's hash, so a stale or foreign cache gives the same verdict, only slower.
  cache_root="${OMNI_PD_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/omni-pd}"
  .venv/bin/mypy --cache-dir "$cache_root/mypy"
  site="$(mktemp -d)"
  # not --quiet: it silences the warnings, and with them what --strict counts
  .venv/bin/mkdocs build --strict --site-dir "$site"
  rm -rf "$site"
fi
export MC_LOG_LEVEL="${MC_LOG_LEVEL:-ERROR}"
# The run's output is kept to check that pytest reached its summary: a process that ends pytest
# early (a test that lets os._exit run in-process) would otherwise pass with tests never run.
log="$(mktemp)"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@" | tee "$log"  # the slowest, for CI time budgeting
if ! grep -Eq '^=* ?[0-9]+ (passed|failed|skipped|deselected)' "$log"; then
  echo "test.sh: pytest ended without its summary line: a test ended the process" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
# The P/D equivalence and prefix-cache suites (P/D = colocated, batched = alone, streamed = whole,
# cached = uncached, each with its negative control) again with every hf stage in bfloat16, where
# this CPU has bf16 arithmetic.
if [ "${OMNI_PD_BF16:-1}" = "1" ]; then
  if why="$(.venv/bin/python -c 'import torch; from omni_pd.engines.device import check_dtype; check_dtype("cpu", torch.bfloat16, 0)' 2>&1)"; then
    echo "test.sh: the P/D equivalence and prefix-cache suites again in bfloat16"
    OMNI_PD_E2E_DTYPE=bfloat16 .venv/bin/python -m pytest -q -p no:cacheprovider \
      e2e/test_pd_equivalence.py e2e/test_prefix_caching.py "$@" || [ $? -eq 5 ]
  else
    echo "test.sh: no bfloat16 suite on this host: ${why##*: }"
  fi
fi
[ "${OMNI_PD_SECOND_ISA:-1}" = "1" ] || exit 0
other="$(.venv/bin/python -m omni_pd.engines.hf.compute_identity --older)"
if [ -z "$other" ]; then
  echo "test.sh: torch has no older CPU level than this host's to check exactness under"
  exit 0
fi
echo "test.sh: the exactness suites again under ATEN_CPU_CAPABILITY=$other"
# 5: no test selected (extra arguments that name no exactness test).
ATEN_CPU_CAPABILITY="$other" .venv/bin/python -m pytest -q -p no:cacheprovider -m exactness "$@" || [ $? -eq 5 ]
