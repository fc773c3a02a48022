#!/usr/bin/env bash
# The program suite (bench_programs) on one GPU: dummy Llama-3-8B in bf16, full shapes, the
# KV pool at KV_FRACTION of the largest program working set. One PART per invocation, each
# its own JSON / table / plot in $OUT (programs-<part>.*) and each within PART_TIMEOUT_S (an
# engine or server starts no program after CONFIG_TIMEOUT_S, keeping the rows it finished;
# the frontend part's three configs share one engine, so they share that time):
#   radix      radix (+lpm) and blockhash: hit rate / optimal, radix vs block-hash
#   frontend   no-parallel, no-hints, no-admission (DSL ablations on radix+lpm)
#   order      fcfs, random (admission-order ablations)
#   no-cache   no prefix cache
#   server     DSL over HTTP vs the sequential and asyncio OpenAI clients (latency)
#   all        every part above, one after another
#
# Any CUDA machine with the package, its `gpu` extra and `openai` installed:
#   PART=radix bash benchmarks/run_h200_programs.sh
# Environment:
#   PART              which part (default all)
#   PYTHON            the interpreter that has radixrt installed (default python3)
#   OUT               output directory (default benchmarks/out/h200)
#   SCALE             x num_programs of every program (default 0.5)
#   KV_FRACTION       KV pool / largest program working set (default 0.4)
#   PART_TIMEOUT_S    wall limit of one part (default 570)
#   CONFIG_TIMEOUT_S  an engine or server starts no program after this (default 420)
#   EXTRA             more bench_programs arguments (e.g. "--programs mmlu,json --num-kv-blocks 981")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/h200}
PYTHON=${PYTHON:-python3}
PART=${PART:-all}
source benchmarks/checkout_env.sh; export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
ARGS=(--model llama-3-8b --device cuda --dtype bfloat16 --size full --scale "${SCALE:-0.5}"
  --kv-fraction "${KV_FRACTION:-0.4}" --out "$OUT" --config-timeout-s "${CONFIG_TIMEOUT_S:-420}")
# shellcheck disable=SC2206
ARGS+=(${EXTRA:-})
declare -A CONFIGS=(
  [radix]=radix,blockhash
  [frontend]=no-parallel,no-hints,no-admission
  [order]=fcfs,random
  [no-cache]=no-cache
  [server]=dsl-http,openai-seq,openai-async
)
parts=("$PART")
[[ $PART == all ]] && parts=(radix frontend order no-cache server)
status=0
for part in "${parts[@]}"; do
  [[ -n ${CONFIGS[$part]:-} ]] || { echo "unknown PART $part"; exit 2; }
  echo "== programs, $part: ${CONFIGS[$part]} =="
  timeout -k 10 "${PART_TIMEOUT_S:-570}" "$PYTHON" -m benchmarks.bench_programs "${ARGS[@]}" \
    --configs "${CONFIGS[$part]}" --tag "programs-$part" > "$OUT/programs-$part.log" 2>&1 \
    || status=$?
  grep -E 'programs/s|PASS|FAIL|SKIP|Error|timeout' "$OUT/programs-$part.log" | tail -n 80
done
exit $status
