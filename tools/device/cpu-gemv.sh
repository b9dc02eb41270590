#!/usr/bin/env bash
# On a GPU machine's host: a patch to the CPU backend's kernels (0007, 0008)
# checked and measured against the CPU modules built before it (carried in
# .carry/old-cpu/), in one call:
#   1. tools/device/cpu-gemv-check.cpp with the old and the new module of
#      each of VARIANTS (default sapphirerapids), for each of CASES
#      (TYPE:BUFT:ROWS, default q4_K:CPU_REPACK:1; BUFT as GEMV_BUFT: CPU_REPACK,
#      AMX or CPU, plain memory): outputs compared bit for bit, and the
#      product timed at 14 and 16 threads (GB/s of weights; the first
#      variant only);
#   2. the CPU backend decoding the Llama-3-8B shape cut to 16 layers in
#      each of BENCH_TYPES (default q4_k q4_k_m), old and new module (tg32,
#      14 threads, `--cpu-amx $CPU_AMX`, default auto);
#   3. with MOE=1, the Qwen3-30B-A3B shape in Q4_K_M at 8G on the GPU,
#      hybrid decode (tg16; the host layers' experts in plain memory),
#      old and new module interleaved over ROUNDS rounds (default 2);
#   4. with HYBRID=1, the 70B-shaped Q4_K_M at 12G, the same way.
#   The CUDA module is the one carried in .carry/cuda, run unstamped beside
#   each CPU module (a CPU-only patch leaves the CUDA module's code as it
#   was). Results in $OUT/cpu-gemv.txt.
#   here: XZ_BIN=1 tools/device/pack.sh VOCAB.gguf; mkdir -p .carry/old-cpu;
#         cp OLD/libggml-cpu-{sapphirerapids,...}.so .carry/old-cpu/
#   device: HYBRID=1 bash tools/device/cpu-gemv.sh              (0007's run)
#           CASES="q6_K:CPU:1 q4_K:CPU:4" VARIANTS="sapphirerapids skylakex" MOE=1 bash tools/device/cpu-gemv.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
f=$out/cpu-gemv.txt
variants=${VARIANTS:-sapphirerapids}
dev_machine
grep -o 'avx512_vnni\|avx512bw\|amx_int8' /proc/cpuinfo | sort -u | paste -sd' ' | sed 's/^/CPU: /' | tee "$f"
old=/root/old-cpu new=/root/new-cpu
mkdir -p $old $new
for variant in $variants; do
  cp .carry/old-cpu/libggml-cpu-$variant.so $old/ || { echo "no old $variant module in .carry/old-cpu" | tee -a "$f"; exit 1; }
  cp $bin/libggml-cpu-$variant.so $new/
done
# 1. the products, bit for bit, and timed
src=/root/gv-src; rm -rf $src; mkdir -p $src
tar -xJf vendor/llama.cpp.tar.xz -C $src
g++ -std=c++17 -O2 -o /root/cpu-gemv-check tools/device/cpu-gemv-check.cpp -I$src/ggml/include \
  -L$bin -l:libggml.so.0 -l:libggml-base.so.0 -Wl,-rpath,$bin 2>&1 | tail -5 | tee -a "$f"
ok=1 first=1
for variant in $variants; do
  for c in ${CASES:-q4_K:CPU_REPACK:1}; do
    IFS=: read -r ty buft rows <<< "$c"
    threads="14 16"; [ $first = 1 ] || threads=14
    for v in old new; do
      d=$old; [ $v = new ] && d=$new
      echo "== $variant, $v module, $ty in $buft, $rows row(s)" | tee -a "$f"
      rm -f /root/gv-$v.*.bin
      GEMV_TYPE=$ty GEMV_BUFT=$buft GEMV_ROWS=$rows /root/cpu-gemv-check $d/libggml-cpu-$variant.so /root/gv-$v $threads 2>&1 \
        | grep -v -e "^repack:" -e "^load_backend" | tee -a "$f"
    done
    for o in /root/gv-old.*.bin; do
      n=/root/gv-new.${o#/root/gv-old.}
      if cmp -s "$o" "$n"; then echo "$variant $c $(basename "$n"): identical" | tee -a "$f"
      else echo "$variant $c $(basename "$n"): DIFFERENT" | tee -a "$f"; ok=0; fi
    done
  done
  first=0
done
[ $ok = 1 ] || { echo "outputs differ: no timings of the engine" | tee -a "$f"; exit 1; }
# the engine's runs load the first variant's old or new module
v0=${variants%% *}
for v in old new; do
  d=$old; [ $v = new ] && d=$new
  for x in $variants; do [ $x = $v0 ] || mv $d/libggml-cpu-$x.so $d/unused-$x.so; done
done
# 2. the CPU backend decoding
for t in ${BENCH_TYPES:-q4_k q4_k_m}; do
  m8=$(TYPE=$t dev_synth llama3-8b 16)
  for v in old new; do
    d=$old; [ $v = new ] && d=$new
    STRATA_BACKEND_DIR=$d timeout 120 $bin/strata bench -m "$m8" --device cpu -t 14 --cpu-amx ${CPU_AMX:-auto} -p 0 -n 32 -B 0 -r 3 2>&1 | quiet \
      | grep -e tg32 -e rror | sed "s/^/$t, $v module: /" | tee -a "$f"
  done
done
# 3-4. hybrid decode on the GPU
if [ -n "${MOE:-}${HYBRID:-}" ]; then
  cat .carry/cuda/libggml-cuda.so.xz.part-* | xz -d > $new/libggml-cuda.so
  cp $new/libggml-cuda.so $old/
fi
hybrid() {  # MODEL BUDGET LABEL [FLAGS]
  for r in $(seq ${ROUNDS:-2}); do
    for v in old new; do
      d=$old; [ $v = new ] && d=$new
      echo "-- $3, round $r, $v CPU module" | tee -a "$f"
      STRATA_BACKEND_DIR=$d timeout 150 $bin/strata bench -m "$1" --device gpu --gpu-budget $2 ${4:-} -p 0 -n 16 -B 0 -r 2 2>&1 \
        | quiet | grep -e "tg16" -e "host CPU" -e "^hybrid" -e rror | tee -a "$f"
    done
  done
}
[ -n "${MOE:-}" ] && hybrid "$(TYPE=q4_k_m dev_synth qwen3-30b-a3b)" 8G "Qwen3-30B-A3B shape, Q4_K_M, 8G" "-c 4096"
[ -n "${HYBRID:-}" ] && hybrid "$(TYPE=q4_k_m dev_synth llama3-70b)" 12G "70B shape, Q4_K_M, 12G"
for g in machine.txt synth.txt; do
  [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
done
exit 0
