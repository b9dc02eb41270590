#!/usr/bin/env bash
# On the GPU machine: (1) CUDA vs CPU (same tokens) and vs llama.cpp on small
# synthetic models, resident and streamed; (2) decode-oriented 70B bench at a
# 12 GB budget side by side with llama.cpp at 24 GPU layers.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}; mkdir -p "$out"
source tools/device-bin.sh
mkdir -p /root/m
[ -f $bin/libggml-cuda.so ] || bash tools/device-restore-module.sh | tee "$out/module.txt"
f() { grep -v -e "^load_backend" -e "^ggml_cuda_init" -e "^  Device 0"; }
v=.carry/models/vocab-smollm2.gguf
[ "${SKIP_SMALL:-0}" = 1 ] || {
  for spec in "llama3-8b 8" "qwen2.5-7b 4"; do
    set -- $spec
    $bin/strata-convert synth --preset $1 --type q4_0 --layers $2 --vocab-from $v /root/m/$1-$2.gguf
    echo "== $1 ($2 layers) resident"; $bin/strata check -m /root/m/$1-$2.gguf --device gpu --with-cpu -n 16 -c 512 2>&1 | f
    echo "== $1 ($2 layers) every group streamed"; $bin/strata check -m /root/m/$1-$2.gguf --device gpu --with-cpu -n 16 -c 512 --stream-all --slots 2 2>&1 | f
  done
} | tee "$out/check_small.txt"
m=/root/m/llama3-70b-q4_0.gguf
[ -f "$m" ] || $bin/strata-convert synth --preset llama3-70b --type q4_0 --vocab-from $v "$m" | tee "$out/synth.txt"
$bin/strata bench -m "$m" --device gpu --gpu-budget 12G -b 64 -c 1536 --slots 3 -p 64 -n 16 -B 8,64 --batch-steps 4 -r 3 \
  --llama-ngl 24 --trace "$out/trace_70b_decode.json" 2>&1 | f | tee "$out/bench_70b_decode.txt"
