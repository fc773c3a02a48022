#!/usr/bin/env bash
# bench_router on one GPU: N replicas of a dummy model (bf16; PRESET, default Llama-3.2-1B)
# behind sglang-router, each with a fixed KV pool (`--num-kv-blocks`, so they share the GPU),
# per policy (cache_aware, round_robin, power_of_two), against one server with their total
# KV; full shapes. Every server is started here (fresh per workload and config); results go
# to $OUT/$TAG.{json,md} after every run, so a run stopped by BUDGET_S keeps what it finished.
#
# Needs radixrt's `gpu` extra and sglang-router (`router` extra, or its wheels on PYTHONPATH):
#   bash benchmarks/run_h200_router.sh
# Environment:
#   PYTHON         the interpreter that has radixrt installed (default python3)
#   OUT            output directory (default benchmarks/out/h200)
#   TAG            output name (default router-h200)
#   PRESET         model shape, a radixrt.model.presets name (default llama-3.2-1b)
#   REPLICAS       N (default 2)
#   WORKLOADS      comma list (default shared-prefix,multi-turn)
#   CONFIGS        comma list (default single,cache_aware,round_robin,power_of_two)
#   BUDGET_S       wall limit of the whole benchmark (default 560)
#   RUN_TIMEOUT_S  wall limit of one run (default 90)
#   EXTRA          more bench_router options, one string (e.g. "--router-args '...'")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/h200}
PYTHON=${PYTHON:-python3}
source benchmarks/checkout_env.sh; export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PRESET=${PRESET:-llama-3.2-1b}
MODEL=$OUT/$PRESET-dummy
"$PYTHON" -c "import sys; from radixrt.model.presets import write_dummy_model_dir as w; \
w(sys.argv[1], sys.argv[2])" "$MODEL" "$PRESET" || exit 1
TAG=${TAG:-router-h200}
eval "extra=(${EXTRA:-})"
timeout -k 15 "${BUDGET_S:-560}" "$PYTHON" -m benchmarks.bench_router --size full \
  --model "$MODEL" --load-format dummy --device cuda --dtype bfloat16 \
  --replicas "${REPLICAS:-2}" --workloads "${WORKLOADS:-shared-prefix,multi-turn}" \
  --configs "${CONFIGS:-single,cache_aware,round_robin,power_of_two}" \
  --run-timeout-s "${RUN_TIMEOUT_S:-90}" --startup-timeout-s 240 --out "$OUT" --tag "$TAG" \
  "${extra[@]}" 2>&1 | tee "$OUT/$TAG.log" | grep -v '^ *$'
status=${PIPESTATUS[0]}
if [[ $status -ne 0 && -f $OUT/$TAG.md ]]; then
  echo "== stopped (exit $status); the runs that finished:"; cat "$OUT/$TAG.md"
fi
exit "$status"
