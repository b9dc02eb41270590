#!/usr/bin/env bash
# Q6_K experts on the host with and without ggml's tiled mul_mat_id
# (ggml-cpu/tiled: it takes an expert picked by 8 rows or more; the
# GGML_CPU_TILED_MM=0 environment variable turns it off, and vendor patch
# 0010's rows kernel then takes every expert), one call:
# 1. tools/device/cpu-moe-check.cpp, Q6_K, 64 tokens (TOKENS), uniform and
#    skewed routing, the new module and .carry/old-cpu's, tiled on and off
#    (cpu-moe.txt);
# 2. the engine on the skewed Qwen3-30B-A3B shape in the Q4_K_M mix at 8G,
#    64 sequences, the new module with the tiled path on and off and the
#    old module, interleaved, ROUNDS rounds (default 2) (ab.txt).
#   here: as tools/device/rows-ab.sh's header says (.carry/old-cpu/ holds the old module)
#   device: export OUT=$OUT; bash tools/device/tiled-ab.sh
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_machine > "$out/machine.txt"
dev_module_start
s=$(SKEW=1 TYPE=q4_k_m dev_synth qwen3-30b-a3b)
src=/root/moe-src; rm -rf $src; mkdir -p $src
tar -xJf vendor/llama.cpp.tar.xz -C $src
g++ -std=c++17 -O2 -o /root/cpu-moe-check tools/device/cpu-moe-check.cpp -I$src/ggml/include \
  -L$bin -l:libggml.so.0 -l:libggml-base.so.0 -Wl,-rpath,$PWD/$bin 2>&1 | tail -5
dev_module_wait > /dev/null
m=$bin/libggml-cpu-sapphirerapids.so
cp $m /root/new-cpu.so
for skew in 0 1; do
  for v in old new; do
    for tiled in 1 0; do
      mod=.carry/old-cpu/libggml-cpu-sapphirerapids.so; [ $v = new ] && mod=/root/new-cpu.so
      echo "== $v module, Q6_K, skew $skew, GGML_CPU_TILED_MM=$tiled"
      GGML_CPU_TILED_MM=$tiled MOE_SKEW=$skew MOE_TYPE=q6_K MOE_TOKENS="${TOKENS:-64}" \
        MOE_REPS=${MOE_REPS:-10} /root/cpu-moe-check $mod 14 2>&1 | grep -v -e "^repack:" -e "^load_backend"
    done
  done
done > "$out/cpu-moe.txt"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in new-untiled new old; do
    if [ $v = old ]; then cp .carry/old-cpu/libggml-cpu-sapphirerapids.so $m; else cp /root/new-cpu.so $m; fi
    tiled=1; [ $v = new-untiled ] && tiled=0
    echo "== round $r, $v: GGML_CPU_TILED_MM=$tiled strata bench -m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -n 0 -B 64 -r 2"
    GGML_CPU_TILED_MM=$tiled STRATA_LOG=strata=info timeout 100 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G \
      -c 4096 -b 2048 -ub 2048 -p 0 -n 0 -B 64 -r 2 2>&1 | quiet
  done
done > "$out/ab.txt"
cp /root/new-cpu.so $m
