#!/usr/bin/env bash
# On a GPU machine: vendor/patches/0004 and 0006 (the vectorized
# dequantizations big steps use before cuBLAS: Q4_0; Q4_K, Q5_K, Q6_K)
# checked and measured, in one call:
#   1. tools/device/dequant-check.cu: each new kernel against ggml's, bit
#      for bit (BF16, F16, F32), and both timed;
#   2. the 70B-shaped model (TYPE: q4_0 unless set, q4_k_m for llama.cpp's
#      Q4_K_M mix) at pp2048 (TESTS replaces `-p 2048 -b 2048 -ub 2048 -n 0
#      -B 0 -r 4`) with the module built here (the patches) and with the
#      one carried in .carry/cuda (built before the newest: run from
#      /root/oldmod, unstamped, with the same binary), interleaved over
#      ROUNDS rounds (default 1), for each of CONFIGS (default "row one":
#      the row split at 12G on each of two GPUs, one GPU at 12G; also
#      row-whole, the row split without halves, --row-halves 0);
#   3. with CUPTI=1, the new module's kernels summed over one step of each
#      config (tools/device/kernel-sum.py).
# Results in $OUT/dequant.txt; the new module comes back in $OUT/cuda.
#   XZ_BIN=1 tools/device/pack.sh VOCAB.gguf   (here; .carry/cuda holds the
#   module of the source before the patch), then on the device:
#   CUPTI=1 bash tools/device/dequant-ab.sh
#   TYPE=q4_k_m CONFIGS=one bash tools/device/dequant-ab.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
source tools/device/cupti-trace.sh
f=$out/dequant.txt
# the carried module (the source before the patch), kept aside unstamped
o=/root/oldmod; mkdir -p $o
if ls .carry/cuda/libggml-cuda.so.xz.part-* >/dev/null 2>&1; then
  cat .carry/cuda/libggml-cuda.so.xz.part-* | xz -d > $o/libggml-cuda.so
  echo "old module: $(paste -sd' ' .carry/cuda/libggml-cuda.so.ggml-version)" | tee "$f"
else
  echo "no module in .carry/cuda: no comparison" | tee "$f"; o=
fi
dev_70b || exit 1
dev_keep_module
[ -n "$o" ] && cp $bin/libggml-cpu-*.so $o/
# 1. bit for bit
src=/root/dq-src; rm -rf $src; mkdir -p $src
tar -xJf vendor/llama.cpp.tar.xz -C $src && bash vendor/source.sh apply $src
echo "== dequant-check" | tee -a "$f"
$(command -v nvcc || echo /usr/local/cuda/bin/nvcc) -arch=sm_90 -std=c++17 -O2 -o /root/dequant-check tools/device/dequant-check.cu -I$src/ggml/include \
  -I$src/ggml/src -I$src/ggml/src/ggml-cuda 2>&1 | tail -5 | tee -a "$f"
/root/dequant-check 2>&1 | tee -a "$f"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "dequant-check FAILED: no timings" | tee -a "$f"; exit 1; }
# 2. interleaved
tests=${TESTS:-"-p 2048 -b 2048 -ub 2048 -n 0 -B 0 -r 4"}
for r in $(seq ${ROUNDS:-1}); do
  for c in ${CONFIGS:-row one}; do
    for v in new ${o:+old}; do
      echo "-- round $r: $c, $v module" | tee -a "$f"
      env $([ $v = old ] && echo STRATA_BACKEND_DIR=$o) timeout 200 $bin/strata bench -m "$m" --device gpu \
        --gpu-budget 12G $(dev_split_flags $c) $tests 2>&1 | quiet | grep -e "pp[0-9]" -e rror | tee -a "$f"
    done
  done
done
# 3. where the new module's step goes
if [ -n "${CUPTI:-}" ] && cupti_build 2>&1 | tee -a "$f" && [ -f /root/cupti-trace.so ]; then
  for c in ${CONFIGS:-row one}; do
    echo "== $c, new module, CUPTI" | tee -a "$f"
    CUDA_INJECTION64_PATH=/root/cupti-trace.so CUPTI_TRACE_OUT=/root/trace-$c.tsv timeout 200 $bin/strata bench \
      -m "$m" --device gpu --gpu-budget 12G $(dev_split_flags $c) $tests 2>&1 | quiet | grep -e "pp[0-9]" -e rror | tee -a "$f"
    python3 tools/device/kernel-sum.py /root/trace-$c.tsv 2>&1 | tee -a "$f"
  done
fi
for g in machine.txt module.txt synth.txt; do
  [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
done
