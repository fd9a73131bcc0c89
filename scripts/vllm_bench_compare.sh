#!/usr/bin/env bash
# vLLM's own benchmark client against bare vLLM and against omni-pd, in one run, on the same tiny
# Qwen3-Omni thinker, text only, with the same prompts (issue 41, item 3).
#
# Each server starts in turn on a free port, `vllm bench serve --backend openai-chat` runs at each
# concurrency with the same seed, prompt and output lengths, the server stops, and a table of the
# medians and p99s read from vLLM's --save-result JSON is printed (and written as markdown).
# With REPEATS=N the whole sequence of servers runs N times in turn (alternating, so a host that
# gets busier part-way hurts every server alike) and each cell is the median over the repeats.
#
#   scripts/vllm_bench_compare.sh [OUT_DIR]
#
# Environment (defaults in brackets):
#   CONFIGS      omni-pd stage files to serve after bare vLLM
#                [stage_configs/ci/qwen3_omni_tiny_vllm.yaml stage_configs/ci/qwen3_omni_tiny_vllm_pd.yaml]
#   CONCURRENCY  levels [1 4]          NUM_PROMPTS  requests per level [32]
#   INPUT_LEN    prompt tokens [256]   OUTPUT_LEN   output tokens (--ignore-eos) [32]
#   SEED         the random dataset's seed [0]   PORT  [8311]   VENV  [.venv]
#   REPEATS      runs of the whole sequence [1]
#   PEER_PD      1: also vLLM's own P/D, the row `vllm-pd` (two `vllm serve` with the
#                MooncakeConnector, kv_producer / kv_consumer, behind scripts/vllm_pd_proxy.py,
#                which does what vLLM's disaggregated-serving examples do) [0]
#
# Bare vLLM serves the checkpoint that omni-pd's vLLM thinker stage loads (the embedded tiny model
# written with the stages' seed 42; its architecture, Qwen3OmniMoeForConditionalGeneration, is
# vLLM's Qwen3-Omni thinker) with the stage's engine arguments. omni-pd is asked for text only
# (`modalities: ["text"]` through --extra-body; vLLM ignores the key), so the talker and code2wav
# do not run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
[ -x "$VENV/bin/vllm" ] || { echo "no $VENV/bin/vllm: OMNI_PD_VLLM=1 scripts/setup.sh, or VENV=DIR" >&2; exit 1; }
OUT=${1:-$(mktemp -d /tmp/vllm_bench_compare.XXXXXX)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONFIGS=${CONFIGS:-"stage_configs/ci/qwen3_omni_tiny_vllm.yaml stage_configs/ci/qwen3_omni_tiny_vllm_pd.yaml"}
CONCURRENCY=${CONCURRENCY:-"1 4"}
NUM_PROMPTS=${NUM_PROMPTS:-32}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-32}
SEED=${SEED:-0}
REPEATS=${REPEATS:-1}
PEER_PD=${PEER_PD:-0}
PORT=${PORT:-8311}
NAME=tiny-qwen3-omni
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_HOST_IP=127.0.0.1 TOKENIZERS_PARALLELISM=false

CKPT=$("$VENV/bin/python" -c "from omni_pd import registry; print(registry.checkpoint_dir('$NAME', 42))" | tail -1)
echo "checkpoint: $CKPT"
echo "out: $OUT"

SERVER=""
stop_server() {  # every process in $SERVER
    for pid in $SERVER; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in $SERVER; do
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null || true
    done
    SERVER=""
}
trap stop_server EXIT

wait_ready() {  # LOG [PORT]: /health answers 200 (omni-pd: every stage up; vLLM: the engine up)
    for _ in $(seq 600); do
        for pid in $SERVER; do
            kill -0 "$pid" 2>/dev/null || { echo "server exited; log: $1" >&2; tail -20 "$1" >&2; exit 1; }
        done
        curl -sf -o /dev/null "http://127.0.0.1:${2:-$PORT}/health" && return 0
        sleep 1
    done
    echo "server not ready after 600 s; log: $1" >&2
    exit 1
}

bench() {  # LABEL (the repeat's number is $REP)
    for c in $CONCURRENCY; do
        "$VENV/bin/vllm" bench serve --backend openai-chat --base-url "http://127.0.0.1:$PORT" \
            --endpoint /v1/chat/completions --model "$NAME" --tokenizer "$CKPT" \
            --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
            --num-prompts "$NUM_PROMPTS" --max-concurrency "$c" --seed "$SEED" --ignore-eos \
            --temperature 0 --extra-body '{"modalities": ["text"]}' \
            --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
            --save-result --result-dir "$OUT" --result-filename "$1.c$c.r$REP.json" --label "$1" \
            >"$OUT/$1.c$c.r$REP.log" 2>&1 || { echo "bench failed: $OUT/$1.c$c.r$REP.log" >&2; tail -20 "$OUT/$1.c$c.r$REP.log" >&2; exit 1; }
        echo "  $1 concurrency $c done (repeat $REP)"
    done
}

for REP in $(seq "$REPEATS"); do
    # 1. Bare vLLM, the thinker stage's engine arguments (qwen3_omni_tiny_vllm.yaml, stage 0).
    echo "bare vLLM: vllm serve $CKPT (repeat $REP of $REPEATS)"
    "$VENV/bin/vllm" serve "$CKPT" --served-model-name "$NAME" --host 127.0.0.1 --port "$PORT" \
        --dtype float32 --block-size 32 --max-model-len 4096 --enforce-eager --seed 42 \
        --max-num-seqs 64 >"$OUT/server.vllm.r$REP.log" 2>&1 &
    SERVER=$!
    wait_ready "$OUT/server.vllm.r$REP.log"
    bench vllm
    stop_server

    # 1b. vLLM's own P/D: producer and consumer, each the stage's engine arguments, behind the proxy.
    if [ "$PEER_PD" = "1" ]; then
        echo "vLLM P/D: two vllm serve (MooncakeConnector) behind scripts/vllm_pd_proxy.py (repeat $REP of $REPEATS)"
        for role in producer consumer; do
            port=$((PORT + 1)); [ "$role" = consumer ] && port=$((PORT + 2))
            VLLM_MOONCAKE_BOOTSTRAP_PORT=$((PORT + 3)) "$VENV/bin/vllm" serve "$CKPT" --served-model-name "$NAME" \
                --host 127.0.0.1 --port "$port" --dtype float32 --block-size 32 --max-model-len 4096 \
                --enforce-eager --seed 42 --max-num-seqs 64 \
                --kv-transfer-config "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_$role\",\"kv_connector_extra_config\":{\"mooncake_protocol\":\"tcp\"}}" \
                >"$OUT/server.vllm-pd-$role.r$REP.log" 2>&1 &
            SERVER="$SERVER $!"
            wait_ready "$OUT/server.vllm-pd-$role.r$REP.log" "$port"
        done
        "$VENV/bin/python" scripts/vllm_pd_proxy.py --prefill "http://127.0.0.1:$((PORT + 1))" \
            --decode "http://127.0.0.1:$((PORT + 2))" --port "$PORT" >"$OUT/server.vllm-pd-proxy.r$REP.log" 2>&1 &
        SERVER="$SERVER $!"
        wait_ready "$OUT/server.vllm-pd-proxy.r$REP.log"
        bench vllm-pd
        stop_server
    fi

    # 2. omni-pd, each stage file.
    for cfg in $CONFIGS; do
        label=omni-pd:$(basename "$cfg" .yaml)
        echo "omni-pd serve --stage-configs-path $cfg (repeat $REP of $REPEATS)"
        "$VENV/bin/omni-pd" serve "$NAME" --stage-configs-path "$cfg" --host 127.0.0.1 --port "$PORT" \
            --served-model-name "$NAME" --no-demo-page >"$OUT/server.$label.r$REP.log" 2>&1 &
        SERVER=$!
        wait_ready "$OUT/server.$label.r$REP.log"
        bench "$label"
        stop_server
    done
done

"$VENV/bin/python" - "$OUT" "$CONCURRENCY" <<'EOF'
import glob, json, os, statistics, sys
out, levels = sys.argv[1], sys.argv[2].split()
files = sorted(f for f in os.listdir(out) if f.endswith(".json"))
labels = list(dict.fromkeys(f.rsplit(".c", 1)[0] for f in files))
labels.sort(key=lambda l: l != "vllm")
head = ("| server | conc. | repeats | n | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | E2E p50 "
        "| req/s | out tok/s | failed |")
rows = [head, "|" + " --- |" * (head.count("|") - 1)]
medians = {}
keys = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
        "median_e2el_ms", "request_throughput", "output_throughput")
for c in levels:
    for label in labels:
        runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, f"{glob.escape(label)}.c{c}.r*.json")))]
        if not runs:
            continue
        m = {k: statistics.median(r[k] for r in runs) for k in keys}  # each cell: over the repeats
        medians[(c, label)] = m
        rows.append(
            f"| {label} | {c} | {len(runs)} | {runs[0]['completed']} | {m['median_ttft_ms']:.1f} | {m['p99_ttft_ms']:.1f} "
            f"| {m['median_itl_ms']:.2f} | {m['p99_itl_ms']:.2f} | {m['median_tpot_ms']:.2f} "
            f"| {m['median_e2el_ms']:.1f} | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} "
            f"| {sum(r['failed'] for r in runs)} |"
        )
# Against bare vLLM in the same run (issue 48's targets: TTFT and ITL p50 within 1.10x, ITL p99
# within 1.5x, req/s at least 0.95x).
rows += ["", "| server | conc. | TTFT p50 / vLLM | ITL p50 / vLLM | ITL p99 / vLLM | req/s / vLLM |",
         "| --- | --- | --- | --- | --- | --- |"]
for (c, label), m in medians.items():
    base = medians.get((c, "vllm"))
    if base is None or label == "vllm":
        continue
    rows.append(
        f"| {label} | {c} | {m['median_ttft_ms'] / base['median_ttft_ms']:.2f}x "
        f"| {m['median_itl_ms'] / base['median_itl_ms']:.2f}x | {m['p99_itl_ms'] / base['p99_itl_ms']:.2f}x "
        f"| {m['request_throughput'] / base['request_throughput']:.2f}x |"
    )
table = "\n".join(rows)
print(table)
open(os.path.join(out, "table.md"), "w").write(table + "\n")
EOF
echo "results: $OUT (table.md, one JSON per server and level, the servers' logs)"
