#!/usr/bin/env bash
# On a GPU machine's host: the CPU's expert product (mul_mat_id over a
# mixture's stacked experts) in plain memory and repacked, with this
# checkout's CPU module and, where .carry/old-cpu/ holds one, an older
# module (run 143: a gemm path for the repacked product; runs 154-155: a
# VNNI kernel taking an expert's rows 4 at a time; run 176: AMX's tile
# kernel, vendor patch 0009 of fada1cd with this tool's AMX layout; none
# paid in the engine and all were dropped; run 182: today's patch 0009,
# rows up to 4 at a time with prefetch, which did), in one call, with a
# hash of each repacked output to tell whether two modules agree bit for bit:
# tools/device/cpu-moe-check.cpp with each module of each of VARIANTS
# (default sapphirerapids), at each of THREADS (default 16), for uniform
# and skewed routing (MOE_SKEW 0 and 1), Q4_K; and Q6_K with each module at
# the first thread count (x86 repacks no Q6_K: plain memory alone). Results
# in $OUT/cpu-moe.txt.
#   here: XZ_BIN=1 tools/device/pack.sh; optionally mkdir -p .carry/old-cpu;
#         cp OLD/libggml-cpu-{sapphirerapids,...}.so .carry/old-cpu/
#   device: bash tools/device/cpu-moe.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
f=$out/cpu-moe.txt
dev_machine
grep -o 'avx512_vnni\|avx512bw\|amx_int8' /proc/cpuinfo | sort -u | paste -sd' ' | sed 's/^/CPU: /' | tee "$f"
nproc | sed 's/^/cores: /' | tee -a "$f"
src=/root/moe-src; rm -rf $src; mkdir -p $src
tar -xJf vendor/llama.cpp.tar.xz -C $src
g++ -std=c++17 -O2 -o /root/cpu-moe-check tools/device/cpu-moe-check.cpp -I$src/ggml/include \
  -L$bin -l:libggml.so.0 -l:libggml-base.so.0 -Wl,-rpath,$PWD/$bin 2>&1 | tail -5 | tee -a "$f"
threads=${THREADS:-16}; t0=${threads%% *}
for variant in ${VARIANTS:-sapphirerapids}; do
  for t in $threads; do
    for skew in 0 1; do
      for v in old new; do
        m=.carry/old-cpu/libggml-cpu-$variant.so; [ $v = new ] && m=$bin/libggml-cpu-$variant.so
        [ -f $m ] || continue
        echo "== $variant, $v module, skew $skew" | tee -a "$f"
        MOE_SKEW=$skew MOE_TOKENS="${TOKENS:-1 4 8 16 32 64}" /root/cpu-moe-check $m $t 2>&1 \
          | grep -v -e "^repack:" -e "^load_backend" | tee -a "$f"
      done
    done
  done
  # Q6_K with each module (vendor/patches/candidates/0010 changes its
  # product), skewed routing too: hashes equal when the outputs are
  for skew in 0 1; do
    for v in old new; do
      m=.carry/old-cpu/libggml-cpu-$variant.so; [ $v = new ] && m=$bin/libggml-cpu-$variant.so
      [ -f $m ] || continue
      echo "== $variant, $v module, Q6_K (plain only on x86), skew $skew" | tee -a "$f"
      MOE_SKEW=$skew MOE_TYPE=q6_K MOE_TOKENS="${TOKENS:-1 4 16 64}" /root/cpu-moe-check $m $t0 2>&1 \
        | grep -v -e "^repack:" -e "^load_backend" | tee -a "$f"
    done
  done
done
for g in machine.txt; do
  [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
done
exit 0
