#!/usr/bin/env bash
# On the GPU machine, after a change to how ggml is built or bound: the
# CUDA module built from vendor/ (kept for the carry cache), strata on CUDA
# against llama.cpp on CUDA and strata on the CPU on small synthetic models,
# resident and streamed (STAGE=1), then the 12G decode bench beside
# llama.cpp at ngl=24 with its defaults (STAGE=2; the machine must still hold
# /root/m and /root/cuda from stage 1).
#   tools/pack-device.sh VOCAB.gguf   (here, with no module in .carry-cache)
#   STAGE=1 bash tools/device-parity.sh; STAGE=2 bash tools/device-parity.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device-70b.sh
if [ "${STAGE:-1}" = 1 ]; then
  cat "$out/module.txt" 2>/dev/null
  # the module for later carries: xz parts of 8 MiB (what a device call returns)
  mkdir -p "$out/cuda"
  xz -T0 -6 -c /root/cuda/libggml-cuda.so | split -b 8M - "$out/cuda/libggml-cuda.so.xz.part-"
  cp /root/cuda/libggml-cuda.so.ggml-version "$out/cuda/"
  for spec in "llama3-8b 8" "qwen2.5-7b 4"; do
    set -- $spec
    [ -f /root/m/$1-$2.gguf ] || $bin/strata-convert synth --preset $1 --type q4_0 --layers $2 --vocab-from $v /root/m/$1-$2.gguf | tail -1
    echo "== $1 ($2 layers) resident"; $bin/strata check -m /root/m/$1-$2.gguf --device gpu --with-cpu -n 16 -c 512 2>&1 | f
    echo "== $1 ($2 layers) every group streamed"; $bin/strata check -m /root/m/$1-$2.gguf --device gpu --with-cpu -n 16 -c 512 --stream-all --slots 2 2>&1 | f
  done 2>&1 | tee "$out/check_small.txt"
  echo "== 70B greedy tokens at 12G"; $bin/strata run -m "$m" --device gpu --gpu-budget 12G -c 1024 -p "The capital of France is" -n 8 --temp 0 2>&1 | f | tee "$out/run_70b.txt"
else
  # streamed groups computed on the GPU only (the CPU's groups of hybrid
  # decode round differently from CUDA's kernels)
  echo "== llama3-8b (8 layers) every group streamed, hybrid off"
  $bin/strata check -m /root/m/llama3-8b-8.gguf --device gpu -n 16 -c 512 --stream-all --slots 2 --hybrid off 2>&1 | f | tee "$out/check_streamed_gpu_only.txt"
  echo "== 12G: strata bench, 64 sequences x 8 decode steps after 16-token prompts; llama.cpp ngl=24 (defaults)"
  $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -c 4096 -b 512 -p 0 -n 0 -B 64 -r 2 --llama-ngl 24 2>&1 | f | tee "$out/bench_12g.txt"
fi
