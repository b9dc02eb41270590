#!/usr/bin/env bash
# A CPU module against the one before it (written for vendor patch 0009, the
# repacked Q4_K expert product a few rows at a time, prefetching; it serves
# vendor/patches/candidates/0010, Q6_K's, the same way), one call:
# 1. tools/device/cpu-moe.sh: the expert product alone with both modules,
#    NMSE against plain memory and an output hash each (equal hashes: the
#    same bits), at 1, 4, 16 and 64 tokens (cpu-moe.txt);
# 2. the engine on the Qwen3-30B-A3B shape in the Q4_K_M mix at 8G, tg16
#    and 64 sequences, ROUNDS rounds (default 2) of the old and the new
#    module interleaved in the same binaries (ab.txt);
#    with SKEW set, the skewed file.
# The CUDA module, where this call built it, is kept into $OUT/cuda first
# (dev_keep_module), so a call cut short still returns it; TOKENS (default
# "1 4 16 64") and MOE_REPS (10) set cpu-moe.sh's token counts and
# repetitions, after the engine's rounds.
#   here: keep the old module: mkdir -p /tmp/old-cpu && tar -xJf .carry/bin.tar.xz -O
#         bin/libggml-cpu-sapphirerapids.so > /tmp/old-cpu/libggml-cpu-sapphirerapids.so;
#         XZ_BIN=1 tools/device/pack.sh VOCAB; mkdir -p .carry/old-cpu; cp /tmp/old-cpu/* .carry/old-cpu/
#   device: export OUT=$OUT; bash tools/device/rows-ab.sh
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_machine >/dev/null
dev_module_start
s=$(TYPE=q4_k_m dev_synth qwen3-30b-a3b)
dev_module_wait
dev_keep_module
m=$bin/libggml-cpu-sapphirerapids.so
cp $m /root/new-cpu.so
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in old new; do
    if [ $v = old ]; then cp .carry/old-cpu/libggml-cpu-sapphirerapids.so $m; else cp /root/new-cpu.so $m; fi
    echo "== round $r, $v module: strata bench -m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -n 16 -B 64 -r 2"
    STRATA_LOG=strata=info timeout 200 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -c 4096 -b 2048 \
      -ub 2048 -p 0 -n 16 -B 64 -r 2 2>&1 | quiet
  done
done > "$out/ab.txt"
cp /root/new-cpu.so $m
MOE_REPS=${MOE_REPS:-10} THREADS=14 TOKENS="${TOKENS:-1 4 16 64}" bash tools/device/cpu-moe.sh > /dev/null 2>&1
