#!/usr/bin/env bash
# HTTP server vs in-process engine on one GPU: dummy Llama-3-8B in bf16, random (128 streams
# x 1024 tokens) and shared-prefix (128 x 256), radix cache, one run each:
#   engine          in-process (the reference)
#   server-before   `radixrt serve` of the checkout in $BEFORE (when given: another radixrt
#                   checkout whose benchmarks/ is this one's, so the client is the same)
#   server          `radixrt serve` of this checkout
# Any CUDA machine with the package and its `gpu` extra installed (pip install -e '.[gpu]'):
#   bash benchmarks/run_h200_front.sh
# Environment:
#   PYTHON     the interpreter that has radixrt installed (default python3)
#   OUT        output directory (default benchmarks/out/h200; relative to the repository root)
#   MODEL_DIR  an HF model directory of Llama-3-8B's shape; its weights are not read
#              (--load-format dummy). Default: a config-only directory written to
#              $OUT/llama-3-8b-dummy.
#   BEFORE     optional: the other checkout for the server-before run
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/h200}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the before-run works from another directory
MODEL=${MODEL_DIR:-$OUT/llama-3-8b-dummy}
if [[ -z ${MODEL_DIR:-} ]]; then
  (source benchmarks/checkout_env.sh && "$PYTHON" -c "import sys; \
from radixrt.model.presets import write_dummy_model_dir as w; w(sys.argv[1], 'llama-3-8b')" "$MODEL")
fi
ARGS=(--model "$MODEL" --load-format dummy --device cuda --dtype bfloat16 --size full
  --workloads random,shared-prefix --scale random=0.5,shared-prefix=0.125 --pressure ''
  --configs radix --run-timeout-s 120)
run() { echo "+ $*"; "$@"; }
# this checkout's radixrt (a tree without checkout_env.sh imports from PYTHONPATH alone)
here() {
  (if [[ -f benchmarks/checkout_env.sh ]]; then source benchmarks/checkout_env.sh
   else export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; fi; run "$@")
}
here "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" --backend engine --out "$OUT" --tag front-engine
if [[ -n ${BEFORE:-} ]]; then
  (cd "$BEFORE" && here "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" --backend server \
    --out "$OUT" --tag front-server-before)
fi
here "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" --backend server --out "$OUT" --tag front-server
for tag in front-engine ${BEFORE:+front-server-before} front-server; do
  echo "== $tag"; grep '^| \(random\|shared-prefix\) ' "$OUT/$tag.md"
done
