#!/usr/bin/env bash
# A CUDA module built with a candidate patch against main's, in main's
# binaries (written for vendor/patches/candidates/0011, the expert
# products' column tile from the tokens an expert sees), one call:
# 1. main's module restored from .carry/cuda (built from vendor/patches/),
#    the candidate's built beside it (about 4 minutes) with main's stamp
#    written over its own so main's binaries load it; with KEEP=1 it is
#    kept into $OUT/cuda (dev_keep_module: four of the eight files a call
#    returns);
# 2. `strata check --with-cpu` on a 4-layer cut of the Qwen3-30B-A3B shape
#    with each module: greedy tokens and logits against llama.cpp and
#    against strata on the CPU (check.txt);
# 3. the engine on the full shape in the Q4_K_M mix at 8G, 16 and 64
#    sequences and tg16, ROUNDS rounds (default 2) of main's and the new
#    module interleaved (ab.txt); with SKEW set, the skewed file.
# With TRACE=1, steps 2-3 give way to one traced load of 64 sequences with
# each module (`-p 0 -n 0 -B 64 -r 1 --trace`, FLAGS added: e.g. `--gemm off
# --hybrid 12` for the same plan in both), then one more untraced each
# (trace-old.json.xz, trace-new.json.xz, trace.txt): the GPU's expert
# products are the `ffn N` spans on the compute stream.
#   here: XZ_BIN=1 tools/device/pack.sh VOCAB (.carry-cache holding main's module)
#   device: export OUT=$OUT; SKEW=1 [TRACE=1 FLAGS=...] bash tools/device/mmq-tile-ab.sh
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
patch_file=${PATCH:-vendor/patches/candidates/0011-cuda-mmq-moe-tile-per-expert.patch}
dev_machine > "$out/machine.txt"
dev_module_get >> "$out/module.txt" 2>&1 || exit 1
mkdir -p /root/old-cuda /root/new-cuda
cp /root/cuda/libggml-cuda.so /root/cuda/libggml-cuda.so.ggml-version /root/old-cuda/
# the new module, from a copy of vendor/ with the candidate among the patches
rm -rf /root/cand && mkdir -p /root/cand/tools && cp -r vendor /root/cand/ && cp tools/build-cuda-module.sh /root/cand/tools/
cp "$patch_file" /root/cand/vendor/patches/
(STRATA_CUDA_BUILD=/root/cand-build bash /root/cand/tools/build-cuda-module.sh /root/new-cuda 90 >> "$out/module.txt" 2>&1; echo $? > /root/new-cuda/rc) &
build=$!
s=$(TYPE=q4_k_m dev_synth qwen3-30b-a3b)
[ "${TRACE:-0}" = 1 ] || small=$(TYPE=q4_k_m dev_synth qwen3-30b-a3b 4)
wait $build
[ "$(cat /root/new-cuda/rc)" = 0 ] || { echo "the candidate's module did not build" >> "$out/module.txt"; exit 1; }
echo "new module's own stamp: $(paste -sd' ' /root/new-cuda/libggml-cuda.so.ggml-version)" >> "$out/module.txt"
cp /root/old-cuda/libggml-cuda.so.ggml-version /root/new-cuda/
cp -r /root/new-cuda /root/cuda-keep && mv /root/cuda /root/cuda-main && mv /root/cuda-keep /root/cuda
echo built > /root/cuda/origin
# a call returns at most 8 files: the module's four parts only with KEEP=1
[ "${KEEP:-0}" = 1 ] && dev_keep_module
rm -rf /root/cuda && mv /root/cuda-main /root/cuda
use() { cp /root/$1-cuda/libggml-cuda.so /root/$1-cuda/libggml-cuda.so.ggml-version $bin/; }
if [ "${TRACE:-0}" = 1 ]; then
  for v in old new old new; do
    use $v
    t=; [ -f "$out/trace-$v.json.xz" ] || t="--trace $out/trace-$v.json"
    echo "== $v module: strata bench -m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -n 0 -B 64 -r 1 ${FLAGS:-} $t"
    # shellcheck disable=SC2086
    STRATA_LOG=strata=info timeout 90 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -c 4096 -b 2048 \
      -ub 2048 -p 0 -n 0 -B 64 -r 1 ${FLAGS:-} $t 2>&1 | quiet | grep -v "^\s*$"
    [ -f "$out/trace-$v.json" ] && xz -9 "$out/trace-$v.json"
  done > "$out/trace.txt"
  exit 0
fi
for v in old new; do
  use $v
  echo "== $v module: strata check -m $small --device gpu --with-cpu -n 16"
  timeout 120 $bin/strata check -m "$small" --device gpu --with-cpu -n 16 2>&1 | quiet | tail -12
done > "$out/check.txt"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in old new; do
    use $v
    echo "== round $r, $v module: strata bench -m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -n 16 -B 16,64 -r 2"
    STRATA_LOG=strata=info timeout 110 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -c 4096 -b 2048 \
      -ub 2048 -p 0 -n 16 -B 16,64 -r 2 2>&1 | quiet | grep -v "^\s*$"
  done
done > "$out/ab.txt"
