#!/usr/bin/env bash
# Host KV tier on one GPU, dummy Llama-3-8B (bf16, in-process engine), in parts that each fit
# a 10-minute command (PART=tests | bandwidth | pressure | long-fcfs | long-lpm | all):
#   tests      GPU tests of the tier (fp32 exact; bf16 FlashInfer overlap on/off)
#   bandwidth  write-back / load GB/s of 2048 8B-shaped blocks (4 GiB each way)
#   pressure   multi-turn@kv/3.8 and agent@kv/3.0, radix vs radix-host (HOST_GB, default 16)
#   long-*     long-history@kv/4.0 (48 chats over 4-16k-token histories, short answers),
#              radix vs radix-host under fcfs / lpm (LONG_HOST_GB, default 64; MemAvailable
#              must exceed it: else LONG_SCALE=0.5 LONG_HOST_GB=32)
# Any CUDA machine with the package and its `gpu` extra installed (pip install -e '.[gpu]'):
#   PART=pressure bash benchmarks/run_h200_host_tier.sh
# CPU logic check with the tiny model:  RADIXRT_BENCH_TINY=1 PART=all bash benchmarks/run_h200_host_tier.sh
# Environment: PYTHON (the interpreter that has radixrt installed, default python3), OUT (output
# directory, default benchmarks/out/h200, relative to the repository root), MODEL_DIR (an HF
# model directory of the llama-3-8b-32k preset's shape, weights not read; default: a
# config-only directory written to $OUT/llama-3-8b-32k-dummy), and the knobs above.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/h200}
PYTHON=${PYTHON:-python3}
PART=${PART:-all}
HOST_GB=${HOST_GB:-16}
LONG_HOST_GB=${LONG_HOST_GB:-64}
LONG_SCALE=${LONG_SCALE:-1}
source benchmarks/checkout_env.sh  # this checkout's radixrt and benchmarks
mkdir -p "$OUT"
if [[ ${RADIXRT_BENCH_TINY:-0} == 1 ]]; then
  ARGS=(--device cpu --threads 1 --size smoke)
  PRESSURE_SCALE=0.5; HOST_GB=0.05; LONG_HOST_GB=0.05
  BW_ARGS=(--device cpu --num-layers 4 --blocks 256)
else
  MODEL=${MODEL_DIR:-$OUT/llama-3-8b-32k-dummy}
  if [[ -z ${MODEL_DIR:-} ]]; then
    "$PYTHON" -c "import sys; from radixrt.model.presets import write_dummy_model_dir as w; \
w(sys.argv[1], 'llama-3-8b-32k')" "$MODEL"
  fi
  ARGS=(--model "$MODEL" --load-format dummy --device cuda --dtype bfloat16 --size full)
  PRESSURE_SCALE=multi-turn=0.25,agent=0.25
  BW_ARGS=()
fi
run() { echo "+ $*"; "$@"; }

if [[ $PART == tests || $PART == all ]] && [[ ${RADIXRT_BENCH_TINY:-0} != 1 ]]; then
  run "$PYTHON" -m pytest -q tests/test_host_tier_engine.py tests/test_host_tier_scheduler.py
fi
if [[ $PART == bandwidth || $PART == all ]]; then
  run "$PYTHON" -m benchmarks.bench_host_tier "${BW_ARGS[@]}" | tee "$OUT/host-tier-bandwidth.json"
  run "$PYTHON" -m benchmarks.bench_host_tier "${BW_ARGS[@]}" --shuffle
fi
if [[ $PART == pressure || $PART == all ]]; then
  # the same pool (575 blocks at full size) as the suite's pressure runs
  run "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" --workloads '' \
    --pressure multi-turn,agent --scale "$PRESSURE_SCALE" --configs radix,radix-host \
    --host-kv-gb "$HOST_GB" --run-timeout-s 120 --out "$OUT" --tag host-tier-pressure
fi
for policy in fcfs lpm; do
  if [[ $PART == "long-$policy" || $PART == all ]]; then
    run "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" --workloads '' \
      --pressure long-history --pressure-factor 4 --scale "$LONG_SCALE" \
      --configs "radix+$policy,radix-host+$policy" --host-kv-gb "$LONG_HOST_GB" \
      --run-timeout-s 240 --out "$OUT" --tag "host-tier-long-$policy"
  fi
done
