#!/usr/bin/env bash
# The program suite (bench_programs) on one GPU: dummy Llama-3-8B in bf16, full shapes, the
# KV pool at KV_FRACTION of the largest program working set. Two parts, each its own JSON /
# table / plot in $OUT: the in-process engine configs (radix, ablations: hit rate / optimal,
# radix vs block-hash) and the server configs (DSL over HTTP vs the OpenAI client loops:
# latency per program). Each part stops at PART_TIMEOUT_S, keeping the rows it finished.
#
# Any CUDA machine with the package, its `gpu` extra and `openai` installed:
#   bash benchmarks/run_h200_programs.sh
# Environment:
#   PYTHON          the interpreter that has radixrt installed (default python3)
#   OUT             output directory (default benchmarks/out/h200)
#   SCALE           x num_programs of every program (default 0.5)
#   KV_FRACTION     KV pool / largest program working set (default 0.4)
#   PART_TIMEOUT_S  wall limit of each part (default 540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/h200}
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
ARGS=(--model llama-3-8b --device cuda --dtype bfloat16 --size full --scale "${SCALE:-0.5}"
  --kv-fraction "${KV_FRACTION:-0.4}" --out "$OUT")
status=0
for part in engine server; do
  if [[ $part == engine ]]; then
    configs=radix,blockhash,no-cache,fcfs,random,no-parallel,no-hints
  else
    configs=dsl-http,openai-seq,openai-async
  fi
  echo "== programs, $part configs =="
  timeout -k 10 "${PART_TIMEOUT_S:-540}" "$PYTHON" -m benchmarks.bench_programs "${ARGS[@]}" \
    --configs "$configs" --tag "programs-$part" > "$OUT/programs-$part.log" 2>&1 || status=$?
  grep -E 'programs/s|PASS|FAIL|SKIP|Error' "$OUT/programs-$part.log" | tail -n 80
done
exit $status
