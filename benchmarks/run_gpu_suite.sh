#!/usr/bin/env bash
# The GPU tests (marker `gpu`) on the device machine, from the repository root, after
# `source .device/gpu-env.sh`. Log: $OUT/gpu-tests.log. Files whose imports the machine lacks
# (scipy) are left out and named in the log.
set -uo pipefail
source benchmarks/checkout_env.sh
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
files=$(grep -l "mark.gpu" tests/test_*.py)
if ! python -c "import scipy" 2>/dev/null; then
  echo "left out (no scipy): $(grep -l "scipy" $files | tr '\n' ' ')" > "$OUT/gpu-tests.log"
  files=$(grep -L "scipy" $files)
fi
# shellcheck disable=SC2086
timeout "${SUITE_TIMEOUT_S:-540}" python -m pytest -q -m gpu -p no:cacheprovider $files \
  >> "$OUT/gpu-tests.log" 2>&1
echo "pytest exit: $?" >> "$OUT/gpu-tests.log"
tail -25 "$OUT/gpu-tests.log"
