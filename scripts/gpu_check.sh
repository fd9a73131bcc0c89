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
#      there): omni-pd's first figures at real shapes on a GPU, with the rows `omni-pd plan
#      --profile` fits its step costs to (prompts of 64-2,048 tokens, batches 1-64, contexts
#      256-4,096);
#   6. scripts/gpu_tiles_probe.py: whether the tiled linear layer keeps a row's bits when its tiles
#      run as one batched product per group (what a fast GPU path needs), and what each form costs.
# GPU_CHECK_STEPS=gpu_tests,bench_serve,... runs only those steps.
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

site=/tmp/omni-pd-site
mkdir -p "$site"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { say "gpu_check: installing .whl/ failed"; exit 1; }
fi
# omni-pd runs from the tree here (PYTHONPATH), not installed, but the registry finds its models
# through the `omni_pd.models` entry points: write the dist-info that `pip install` would, from
# pyproject.toml, so spawned stage workers see the same models.
"$PY" - "$site" <<'PY' || { say "gpu_check: writing omni-pd's entry points failed"; exit 1; }
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"omni_pd-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: omni-pd\nVersion: {project['version']}\n")
lines = []
for group, points in project.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {value}" for name, value in points.items()]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
PY
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
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
# Each step has its own time limit (seconds), so one hang costs its step, not the lease.
# GPU_CHECK_STEPS=name,name runs those steps only (a rerun of what failed, within a short lease).
wanted() { [ -z "${GPU_CHECK_STEPS:-}" ] || [[ ",$GPU_CHECK_STEPS," == *",$1,"* ]]; }
step() {
  local name="$1" limit="$2"; shift 2
  local began=$SECONDS rc=0
  wanted "$name" || return 0
  say ""
  say "== $name"
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    say "   ok in $((SECONDS - began)) s"
  else
    [ $rc -eq 124 ] && say "   TIMED OUT after ${limit} s"
    say "   FAILED in $((SECONDS - began)) s (rc $rc); last lines:"
    tail -n 25 "$out/$name.log" | tee -a "$report"
    status=1
  fi
}
# The real-shape checkpoint is written on the CPU while the GPU steps run (it needs no GPU).
real_pid=
if wanted bench_roofline; then
  ( timeout -k 5 240 "$PY" -m omni_pd.entrypoints.cli make-tiny-model "$out/real" --size real --layers 2 \
      > "$out/real_checkpoint.log" 2>&1; echo $? > "$out/real_checkpoint.rc" ) &
  real_pid=$!
fi
step gpu_tests 80 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
wanted gpu_tests && grep -E "passed|failed" "$out/gpu_tests.log" | tail -1 | tee -a "$report"
step pd_equivalence_cuda 120 env OMNI_PD_E2E_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
  e2e/test_pd_equivalence.py -k "pd_equals_colocated or flipped_byte or all_at_once"
wanted pd_equivalence_cuda && grep -E "passed|failed" "$out/pd_equivalence_cuda.log" | tail -1 | tee -a "$report"
step bench_handoff 60 "$PY" -m omni_pd.entrypoints.cli bench handoff --path tcp,cuda_ipc,staged \
  --geometries tiny,30b --tokens 256,1024,4096 --repeats 5 --json "$out/bench_handoff_gpu.json"
wanted bench_handoff && grep -E "^(geometry|---|tiny|Qwen)" "$out/bench_handoff.log" | tee -a "$report"
step bench_serve 70 "$PY" -m omni_pd.entrypoints.cli bench serve --quick --ignore-eos \
  --configs stage_configs/ci/qwen3_omni_tiny_cuda.yaml,stage_configs/ci/qwen3_omni_tiny_cuda_pd.yaml \
  --json "$out/bench_serve_gpu.json"
wanted bench_serve && tail -n 20 "$out/bench_serve.log" | tee -a "$report"
step tiles_probe 45 "$PY" scripts/gpu_tiles_probe.py --json "$out/gpu_tiles_probe.json"
wanted tiles_probe && tee -a "$report" < "$out/tiles_probe.log"
if [ -n "$real_pid" ]; then
  say ""
  say "== real_checkpoint"
  wait $real_pid
  if [ "$(cat "$out/real_checkpoint.rc" 2>/dev/null)" = 0 ]; then
    say "   ok"
  else
    say "   FAILED (rc $(cat "$out/real_checkpoint.rc" 2>/dev/null)); last lines:"
    tail -n 25 "$out/real_checkpoint.log" | tee -a "$report"
    status=1
  fi
fi
step bench_roofline 100 "$PY" -m omni_pd.entrypoints.cli bench roofline "$out/real" --device cuda:0 \
  --dtype bfloat16 --batches 1,4,8,16,64 --prefill-tokens 64,256,1024 --prefill-batches 1 \
  --contexts 256,1024 --repeats 3 \
  --json "$out/bench_roofline_gpu.json" --plot "$out/bench_roofline_gpu.png"
wanted bench_roofline && grep -E "^(host|thinker|talker|code2wav|speech)" "$out/bench_roofline.log" | tee -a "$report"
rm -rf "$out/real"
say ""
say "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); logs and JSON in $out"
exit $status
