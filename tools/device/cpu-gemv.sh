#!/usr/bin/env bash
# On a GPU machine's host: vendor/patches/0007 (Q4_K's one-row product with
# AVX512-VNNI) checked and measured against the CPU modules built before it
# (carried in .carry/old-cpu/), in one call:
#   1. tools/device/cpu-gemv-check.cpp with the old and the new module of
#      VARIANT (default sapphirerapids): outputs compared bit for bit, and
#      the product timed at 14 and 16 threads (GB/s of weights);
#   2. the CPU backend decoding the Llama-3-8B shape cut to 16 layers, in
#      Q4_K and in the Q4_K_M mix, old and new module (tg32, 14 threads);
#   3. with HYBRID=1, the 70B-shaped Q4_K_M at 12G on the GPU, hybrid
#      decode (tg16) with the old and the new CPU module, interleaved over
#      ROUNDS rounds (default 2). The CUDA module is the one carried in
#      .carry/cuda, run unstamped beside each CPU module (0007 touches
#      only the CPU's code, so the carried module's code is this source's).
# Results in $OUT/cpu-gemv.txt.
#   here: XZ_BIN=1 tools/device/pack.sh VOCAB.gguf; mkdir -p .carry/old-cpu;
#         cp OLD/libggml-cpu-sapphirerapids.so .carry/old-cpu/
#   device: HYBRID=1 bash tools/device/cpu-gemv.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
f=$out/cpu-gemv.txt
variant=${VARIANT:-sapphirerapids}
dev_machine
grep -o 'avx512_vnni\|avx512bw\|amx_int8' /proc/cpuinfo | sort -u | paste -sd' ' | sed 's/^/CPU: /' | tee "$f"
old=/root/old-cpu new=/root/new-cpu
mkdir -p $old $new
cp .carry/old-cpu/libggml-cpu-$variant.so $old/ || { echo "no old module in .carry/old-cpu" | tee -a "$f"; exit 1; }
cp $bin/libggml-cpu-$variant.so $new/
# 1. the product, bit for bit, and timed
src=/root/gv-src; rm -rf $src; mkdir -p $src
tar -xJf vendor/llama.cpp.tar.xz -C $src
g++ -std=c++17 -O2 -o /root/cpu-gemv-check tools/device/cpu-gemv-check.cpp -I$src/ggml/include \
  -L$bin -l:libggml.so.0 -l:libggml-base.so.0 -Wl,-rpath,$bin 2>&1 | tail -5 | tee -a "$f"
for v in old new; do
  d=$old; [ $v = new ] && d=$new
  echo "== $v module" | tee -a "$f"
  /root/cpu-gemv-check $d/libggml-cpu-$variant.so /root/gv-$v 14 16 2>&1 | grep -v -e "^repack:" -e "^load_backend" | tee -a "$f"
done
ok=1
for o in /root/gv-old.*.bin; do
  n=/root/gv-new.${o#/root/gv-old.}
  if cmp -s "$o" "$n"; then echo "$(basename "$n"): identical" | tee -a "$f"; else echo "$(basename "$n"): DIFFERENT" | tee -a "$f"; ok=0; fi
done
[ $ok = 1 ] || { echo "outputs differ: no timings of the engine" | tee -a "$f"; exit 1; }
# 2. the CPU backend decoding
for t in q4_k q4_k_m; do
  m8=$(TYPE=$t dev_synth llama3-8b 16)
  for v in old new; do
    d=$old; [ $v = new ] && d=$new
    STRATA_BACKEND_DIR=$d timeout 120 $bin/strata bench -m "$m8" --device cpu -t 14 -p 0 -n 32 -B 0 -r 3 2>&1 | quiet \
      | grep -e tg32 -e rror | sed "s/^/$t, $v module: /" | tee -a "$f"
  done
done
# 3. hybrid decode of the 70B shape at 12G
if [ -n "${HYBRID:-}" ]; then
  cat .carry/cuda/libggml-cuda.so.xz.part-* | xz -d > $new/libggml-cuda.so
  cp $new/libggml-cuda.so $old/
  m=$(TYPE=q4_k_m dev_synth llama3-70b)
  for r in $(seq ${ROUNDS:-2}); do
    for v in old new; do
      d=$old; [ $v = new ] && d=$new
      echo "-- round $r, $v CPU module" | tee -a "$f"
      STRATA_BACKEND_DIR=$d timeout 150 $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 16 -B 0 -r 2 2>&1 \
        | quiet | grep -e "tg16" -e "host CPU" -e "^hybrid" -e rror | tee -a "$f"
    done
  done
fi
for g in machine.txt synth.txt; do
  [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
done
