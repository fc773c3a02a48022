#!/usr/bin/env bash
# HTTP server vs in-process engine on one H200 (issue #19): dummy Llama-3-8B in bf16,
# random (128 streams x 1024 tokens) and shared-prefix (128 x 256), radix cache, one run each:
#   engine          in-process (the reference)
#   server-before   `radixrt serve` of the tree in $BEFORE (when given: a copy of an older
#                   radixrt/ with this tree's benchmarks/, same client)
#   server          `radixrt serve` of this tree
# GPU machine, repository root, carrying .device (and $BEFORE):
#   BEFORE=.old-front bash benchmarks/run_h200_front.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/h200}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the before-run works from another directory
source .device/gpu-env.sh || { echo "run_h200_front.sh: .device/gpu-env.sh failed" >&2; exit 1; }
MODEL=$OUT/llama-3-8b-dummy
"$PYTHON" -c "import sys; from radixrt.model.presets import write_dummy_model_dir as w; \
w(sys.argv[1], 'llama-3-8b')" "$MODEL"
ARGS=(--model "$MODEL" --load-format dummy --device cuda --dtype bfloat16 --size full
  --workloads random,shared-prefix --scale random=0.5,shared-prefix=0.125 --pressure ''
  --configs radix --run-timeout-s 120)
run() { echo "+ $*"; "$@"; }
run "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" --backend engine --out "$OUT" --tag front-engine
if [[ -n ${BEFORE:-} ]]; then
  (cd "$BEFORE" && PYTHONPATH=/tmp/site:$PWD run "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" \
    --backend server --out "$OUT" --tag front-server-before)
fi
run "$PYTHON" -m benchmarks.bench_serving "${ARGS[@]}" --backend server --out "$OUT" --tag front-server
for tag in front-engine ${BEFORE:+front-server-before} front-server; do
  echo "== $tag"; grep '^| \(random\|shared-prefix\) ' "$OUT/$tag.md"
done
