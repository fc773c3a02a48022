#!/usr/bin/env bash
# One GPU call for a before/after comparison: the GPU test suite on this tree, then
# `bench_one_batch --engine-core` (bf16, then FP8 weights + fp8 KV) on a baseline tree and on
# this tree, alternating, on the same machine. Run from the repository root after
# `source .device/gpu-env.sh`; the baseline is a tree unpacked under $BASE (default
# .device/base, e.g. `git archive <commit> | tar -x -C .device/base`). Logs and JSON to $OUT.
#   STEPS   which parts run (default "suite bf16 fp8")
#   ROUNDS  alternations of base/new per precision (default 1)
#   BATCH_TIMEOUT_S  limit of one bench_one_batch run (default 420)
# Steps on this tree only: `fused` (the layer-op choices, bf16 and fp8 KV), `lora` (LoRA
# batches through the engine, the delta kernels), `storage` (the storage tier across a restart,
# 4k/16k/32k-token histories, the disk's read rate).
set -uo pipefail
OUT=${OUT:-benchmarks/out}
BASE=${BASE:-.device/base}
STEPS=${STEPS:-suite bf16 fp8}
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
here=$PWD

one_batch() {  # tree label extra-args...
  local tree=$1 label=$2
  shift 2
  # a tree from before checkout_env.sh imports from its root (its radixrt extended __path__)
  (cd "$tree" && { [[ -f benchmarks/checkout_env.sh ]] && source benchmarks/checkout_env.sh ||
    export PYTHONPATH=$PWD:$PYTHONPATH; } &&
    timeout "${BATCH_TIMEOUT_S:-420}" python -m benchmarks.bench_one_batch --engine-core --json "$OUT/$label.json" "$@" \
      > "$OUT/$label.log" 2>&1)
  echo "$label exit $?"
  tail -12 "$OUT/$label.log"
}

for step in $STEPS; do
  case $step in
    suite) OUT=$OUT bash benchmarks/run_gpu_suite.sh ;;
    bf16 | fp8)
      extra=()
      [[ $step == fp8 ]] && extra=(--quantization fp8 --kv-cache-dtype fp8_e4m3)
      for r in $(seq "$ROUNDS"); do
        one_batch "$BASE" "base-$step-$r" "${extra[@]}"
        one_batch "$here" "new-$step-$r" "${extra[@]}"
      done
      ;;
    fused)
      for kv in auto fp8_e4m3; do
        (source benchmarks/checkout_env.sh && timeout "${BATCH_TIMEOUT_S:-420}" python -m \
          benchmarks.bench_one_batch --fused-ops flashinfer,triton --batches 1,32,256 --iters 20 \
          --kv-cache-dtype $kv --json "$OUT/fused-$kv.json" > "$OUT/fused-$kv.log" 2>&1)
        echo "fused $kv exit $?"
        tail -30 "$OUT/fused-$kv.log"
      done
      ;;
    lora)
      (source benchmarks/checkout_env.sh && timeout "${LORA_TIMEOUT_S:-330}" python -m \
        benchmarks.bench_lora_engine --json "$OUT/lora-engine.json" > "$OUT/lora-engine.log" 2>&1)
      echo "lora engine exit $?"
      tail -40 "$OUT/lora-engine.log"
      (source benchmarks/checkout_env.sh && timeout 120 python -m benchmarks.bench_lora_delta \
        --json "$OUT/lora-delta.json" > "$OUT/lora-delta.log" 2>&1)
      echo "lora delta exit $?"
      tail -30 "$OUT/lora-delta.log"
      ;;
    storage)
      df -h "$here" /tmp | tee "$OUT/storage-df.txt"  # the store lies under the checkout, not /tmp
      (source benchmarks/checkout_env.sh && timeout 420 python -m benchmarks.bench_storage \
        --store-dir "$here" --model llama-3-8b-32k --stores dir --history 4096,16384,32000 --chats 3 \
        --drop-page-cache --policies auto,always --disk-gib 8 > "$OUT/storage.log" 2>&1)
      echo "storage exit $?"
      grep '^{' "$OUT/storage.log" || tail -30 "$OUT/storage.log"
      ;;
    *) echo "unknown step $step" ;;
  esac
done
