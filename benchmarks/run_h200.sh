#!/usr/bin/env bash
# The H200 benchmark in one script: HF transformers baseline on the random workload, then
# radix+lpm / blockhash+fcfs / none side by side on every workload (+ memory pressure), all
# with the dummy (random-weight) Llama-3-8B preset in bf16 on CUDA, in-process engine.
# Writes JSON / PNG / tables / logs to $OUT (relative paths are taken from the repository root) and prints the table and the targets last.
#
# Any CUDA machine with the package and its `gpu` extra installed (pip install -e '.[gpu]'),
# from anywhere:
#   bash benchmarks/run_h200.sh
# Logic check on a CPU with the tiny model (small sizes, same steps):
#   RADIXRT_BENCH_TINY=1 OUT=/tmp/h200-check bash benchmarks/run_h200.sh
#
# Expected on one H200: HF ~2 min, suite ~5 min (plus ~2 min the first time FlashInfer
# compiles its kernels). Hard stop after BUDGET_S; every finished run is kept.
# Environment:
#   PYTHON        the interpreter that has radixrt installed (default python3)
#   OUT           output directory (default benchmarks/out/h200)
#   MODEL_DIR     an HF model directory of Llama-3-8B's shape; its weights are not read
#                 (--load-format dummy). Default: a config-only directory written to
#                 $OUT/llama-3-8b-dummy.
#   BUDGET_S      total wall budget in seconds (default 530)
#   HF_BATCH      HF baseline batch size (128)
#   SUITE_SCALE   --scale of bench_serving
#   RUN_TIMEOUT_S per-run timeout of bench_serving (60)
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/h200}
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-530}
TINY=${RADIXRT_BENCH_TINY:-0}
source benchmarks/checkout_env.sh  # this checkout's radixrt and benchmarks
mkdir -p "$OUT"
rm -f "$OUT"/hf.json "$OUT"/suite.json "$OUT"/suite.md "$OUT"/suite.png
started=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - started))); }

if [[ $TINY == 1 ]]; then
  MODEL_ARGS=(--device cpu --threads 1)
  HF_ARGS=(--size smoke --batch-size "${HF_BATCH:-32}")
  SUITE_ARGS=(--size smoke --scale "${SUITE_SCALE:-0.25}")
  HF_TIMEOUT_S=120
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    | tee "$OUT/gpu.txt" || true
  MODEL=${MODEL_DIR:-$OUT/llama-3-8b-dummy}
  if [[ -z ${MODEL_DIR:-} ]]; then
    "$PYTHON" -c "import sys; from radixrt.model.presets import write_dummy_model_dir as w; \
w(sys.argv[1], 'llama-3-8b')" "$MODEL"
  fi
  MODEL_ARGS=(--model "$MODEL" --device cuda --dtype bfloat16)
  # random workload at full size: 1024 in / 1024 out; HF runs one static batch of it.
  HF_ARGS=(--random-weights --size full --batch-size "${HF_BATCH:-128}" --max-batches 1)
  # Full shapes (lengths, turns, steps, fan-out), fewer sessions so it all fits the budget.
  SUITE_ARGS=(--load-format dummy --size full --scale "${SUITE_SCALE:-shared-prefix=0.125,\
multi-turn=0.25,agent=0.25,tree-of-thought=0.25,few-shot=0.125,random=1}")
  HF_TIMEOUT_S=190
fi
{ date; uname -a; lscpu | grep -E 'Model name|^CPU\(s\)' || true; } > "$OUT/host.txt"

echo "== HF transformers baseline (timeout ${HF_TIMEOUT_S}s) =="
hf_status=0
timeout -k 10 "$HF_TIMEOUT_S" "$PYTHON" -m benchmarks.bench_hf "${MODEL_ARGS[@]}" "${HF_ARGS[@]}" \
  --out "$OUT" --tag hf > "$OUT/hf.log" 2>&1 || hf_status=$?
tail -n 3 "$OUT/hf.log"
HF_BASELINE=()
if [[ $hf_status == 0 && -f $OUT/hf.json ]]; then HF_BASELINE=(--hf-baseline "$OUT/hf.json"); fi

suite_timeout=$(($(left) - 15))
echo "== serving suite (timeout ${suite_timeout}s; progress in $OUT/suite.err) =="
suite_status=0
timeout -k 10 "$suite_timeout" "$PYTHON" -m benchmarks.bench_serving "${MODEL_ARGS[@]}" \
  "${SUITE_ARGS[@]}" "${HF_BASELINE[@]}" --run-timeout-s "${RUN_TIMEOUT_S:-60}" \
  --out "$OUT" --tag suite > "$OUT/suite.log" 2> "$OUT/suite.err" || suite_status=$?
grep -E '^ *[a-z-]+(@kv/[0-9.]+)? +[a-z]+\+[a-z]+:' "$OUT/suite.log" || true  # one line a run

echo
echo "== results ($((SECONDS - started)) s; hf exit $hf_status, suite exit $suite_status) =="
if [[ -f $OUT/hf.json ]]; then tail -n 1 "$OUT/hf.log"; fi
if [[ -f $OUT/suite.md ]]; then cat "$OUT/suite.md"; else tail -n 30 "$OUT/suite.err"; fi
[[ $suite_status == 0 ]]
