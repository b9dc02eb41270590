#!/usr/bin/env bash
# On a GPU machine's host: which of the CPU's weight layouts multiplies
# fastest at the step sizes hybrid decode gives the host CPU. For each of
# TYPES (default "q4_0 q4_K q6_K"), each layout the module offers for it
# (AMX, CPU_REPACK, plain CPU memory) and each of ROWS (default "1 4 16"),
# tools/device/cpu-gemv-check.cpp times a 28672 x 8192 product (a 70B
# FFN matrix) at THREADS (default 14) threads, in GB/s of weights.
# Results in $OUT/cpu-bufts.txt.
#   device: bash tools/device/cpu-bufts.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
f=$out/cpu-bufts.txt
variant=${VARIANT:-sapphirerapids}
grep -o 'avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | paste -sd' ' | sed 's/^/CPU: /' | tee "$f"
src=/root/gv-src; rm -rf $src; mkdir -p $src
tar -xJf vendor/llama.cpp.tar.xz -C $src
g++ -std=c++17 -O2 -o /root/cpu-gemv-check tools/device/cpu-gemv-check.cpp -I$src/ggml/include \
  -L$bin -l:libggml.so.0 -l:libggml-base.so.0 -Wl,-rpath,$bin 2>&1 | tail -5 | tee -a "$f"
for t in ${TYPES:-q4_0 q4_K q6_K}; do
  for b in AMX CPU_REPACK CPU; do
    [ $t = q6_K ] && [ $b = CPU_REPACK ] && continue   # no repacked Q6_K on x86
    [ $t != q6_K ] && [ $b = CPU ] && continue
    for r in ${ROWS:-1 4 16}; do
      GEMV_ONE_SHAPE=1 GEMV_TYPE=$t GEMV_BUFT=$b GEMV_ROWS=$r timeout 60 /root/cpu-gemv-check \
        $bin/libggml-cpu-$variant.so /root/gb ${THREADS:-14} 2>&1 | grep -e "^module" -e threads -e cpu-gemv | tee -a "$f"
    done
  done
done
