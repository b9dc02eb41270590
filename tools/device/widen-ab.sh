#!/usr/bin/env bash
# On the two-GPU machine: the row split's widened halves (each group's
# quantized matrices dequantized once into BF16 for both halves of a big
# step: src/engine/widen.rs, vendor/patches/0005) checked and measured on
# the 70B-shaped Q4_0, in one call:
#   1. `strata check --vs-row-widen off`: a 2048-token step and 8 greedy
#      tokens on the row split at 12G on each GPU, widened against
#      --no-row-widen: the logits must be equal bit for bit (CHECKS, below,
#      adds other pairs);
#   2. pp2048 (TESTS replaces `-p 2048 -b 2048 -ub 2048 -n 0 -B 0 -r 4`)
#      for each of CONFIGS (default "row row-dq one": widened, each half
#      dequantizing again, one GPU at 12G), interleaved over ROUNDS rounds
#      (default 1);
#   3. with CUPTI=1, the kernels of one step of the widened row split
#      (tools/device/kernel-sum.py).
# Results in $OUT/widen.txt; a module built here comes back in $OUT/cuda.
#   XZ_BIN=1 tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   CUPTI=1 bash tools/device/widen-ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
source tools/device/cupti-trace.sh
f=$out/widen.txt
dev_70b || exit 1
dev_keep_module
# CHECKS: pairs THIS:AGAINST of the engine checked (row: widened, row-dq:
# each half dequantizing again, row-whole: no halves) and the second
# engine's widening (on, off); default "row:off"
for c in ${CHECKS:-row:off}; do
  echo "== strata check $(dev_split_flags ${c%%:*}) --vs-row-widen ${c##*:}" | tee -a "$f"
  timeout 300 $bin/strata check -m "$m" --device gpu --gpu-budget 12G $(dev_split_flags ${c%%:*}) \
    -b 2048 -ub 2048 -n 8 --vs-row-widen ${c##*:} 2>&1 | quiet | tail -5 | tee -a "$f"
done
tests=${TESTS:-"-p 2048 -b 2048 -ub 2048 -n 0 -B 0 -r 4"}
# NOBENCH set: the checks alone
for r in $([ -n "${NOBENCH:-}" ] || seq ${ROUNDS:-1}); do
  for c in ${CONFIGS:-row row-dq one}; do
    echo "-- round $r: $c" | tee -a "$f"
    timeout 200 $bin/strata bench -m "$m" --device gpu --gpu-budget 12G $(dev_split_flags $c) $tests 2>&1 \
      | quiet | grep -e "pp[0-9]" -e rror -e widen | tee -a "$f"
  done
done
if [ -n "${CUPTI:-}" ] && cupti_build 2>&1 | tee -a "$f" && [ -f /root/cupti-trace.so ]; then
  echo "== row, CUPTI" | tee -a "$f"
  CUDA_INJECTION64_PATH=/root/cupti-trace.so CUPTI_TRACE_OUT=/root/trace-row.tsv timeout 200 $bin/strata bench \
    -m "$m" --device gpu --gpu-budget 12G $(dev_split_flags row) $tests 2>&1 | quiet | grep -e "pp[0-9]" -e rror | tee -a "$f"
  python3 tools/device/kernel-sum.py /root/trace-row.tsv 2>&1 | tee -a "$f"
fi
for g in machine.txt module.txt synth.txt; do
  [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
done
