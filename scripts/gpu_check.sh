#!/usr/bin/env bash
# The GPU check (issue 30), for a host with a CUDA GPU; under 10 minutes. Prints a short report
# (and writes it to $OUT/gpu_check.txt where $OUT is set, as the device tool's machines do):
#   1. the gpu-marked tests (tests/test_gpu.py: CUDA IPC between processes, GPU pools over
#      Mooncake, device checksums, batch invariance of the thinker on cuda:0);
#   2. the P/D equivalence prompts with every hf stage on cuda:0 (e2e/test_pd_equivalence.py with
#      OMNI_PD_E2E_DEVICE=cuda: colocated against P/D, both on the GPU, negative control included);
#   3. omni-pd bench handoff --path tcp,cuda_ipc,staged (its rows);
#   4. omni-pd bench serve --quick on the GPU configs;
#   5. a real-shape checkpoint (every dimension of Qwen3-Omni-30B-A3B, 2 layers per stack, bf16)
#      and omni-pd bench roofline on it on cuda:0 in bf16 (HBM bandwidth and GEMM peak measured
#      there): omni-pd's first figures at real shapes on a GPU.
# Uses this host's python3 (a GPU image's torch); packages it lacks come from .whl/ (made by
# scripts/gpu_wheels.sh on a machine with PyPI). CPU hosts: nothing here runs (it says so).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
PY="${PYTHON:-python3}"
out="${OUT:-$repo/.gpu_check}"
mkdir -p "$out"
report="$out/gpu_check.txt"
: > "$report"
say() { echo "$*" | tee -a "$report"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/omni-pd-site .whl/*.whl \
    || { say "gpu_check: installing .whl/ failed"; exit 1; }
  export PYTHONPATH="/tmp/omni-pd-site:$repo${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
export MC_LOG_LEVEL=ERROR HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "gpu_check: torch sees no CUDA device on this host: nothing to check (run it where a GPU is lent)"
  exit 2
fi
missing=$("$PY" - <<'PY'
import importlib
names = ["torch", "transformers", "pydantic", "yaml", "xxhash", "mooncake.engine", "fastapi",
         "uvicorn", "openai", "soundfile", "prometheus_client", "tqdm", "matplotlib", "pytest"]
bad = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        bad.append(f"{name} ({type(exc).__name__}: {exc})")
print("; ".join(bad))
PY
)
if [ -n "$missing" ]; then
  say "gpu_check: missing on this host: $missing"
  say "  run scripts/gpu_wheels.sh where PyPI is reachable and carry .whl/ here"
  exit 1
fi
"$PY" - <<'PY' | tee -a "$report"
import torch, transformers
from omni_pd.kv.transport import registers_device_memory
print(f"host: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, Mooncake registers GPU memory: {registers_device_memory()}")
PY

status=0
step() {
  local name="$1"; shift
  local began=$SECONDS
  say ""
  say "== $name"
  if "$@" > "$out/$name.log" 2>&1; then
    say "   ok in $((SECONDS - began)) s"
  else
    say "   FAILED in $((SECONDS - began)) s (rc $?); last lines:"
    tail -n 25 "$out/$name.log" | tee -a "$report"
    status=1
  fi
}
step gpu_tests "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
grep -E "passed|failed" "$out/gpu_tests.log" | tail -1 | tee -a "$report"
step pd_equivalence_cuda env OMNI_PD_E2E_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
  e2e/test_pd_equivalence.py -k "pd_equals_colocated or flipped_byte or all_at_once"
grep -E "passed|failed" "$out/pd_equivalence_cuda.log" | tail -1 | tee -a "$report"
step bench_handoff "$PY" -m omni_pd.entrypoints.cli bench handoff --path tcp,cuda_ipc,staged \
  --geometries tiny,30b --tokens 256,1024,4096 --repeats 5 --json "$out/bench_handoff_gpu.json"
grep -E "^(geometry|---|tiny|Qwen)" "$out/bench_handoff.log" | tee -a "$report"
step bench_serve "$PY" -m omni_pd.entrypoints.cli bench serve --quick --ignore-eos \
  --configs stage_configs/ci/qwen3_omni_tiny_cuda.yaml,stage_configs/ci/qwen3_omni_tiny_cuda_pd.yaml \
  --json "$out/bench_serve_gpu.json"
tail -n 20 "$out/bench_serve.log" | tee -a "$report"
step real_checkpoint "$PY" -m omni_pd.entrypoints.cli make-tiny-model "$out/real" --size real --layers 2
step bench_roofline "$PY" -m omni_pd.entrypoints.cli bench roofline "$out/real" --device cuda:0 \
  --dtype bfloat16 --batches 1,4,16,64 --prefill-batches 1,4 --repeats 3 \
  --json "$out/bench_roofline_gpu.json" --plot "$out/bench_roofline_gpu.png"
grep -E "^(host|thinker|talker|code2wav|speech)" "$out/bench_roofline.log" | tee -a "$report"
rm -rf "$out/real"
say ""
say "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); logs and JSON in $out"
exit $status
