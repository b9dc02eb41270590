#!/usr/bin/env bash
# On the GPU machine: generate the Llama-3-70B-shaped synthetic model (Q4_0,
# 80 layers) and benchmark strata at a 12 GB budget and all-resident
# (stage "strata"), or llama.cpp at 24 and all layers (stage "llama").
#   tools/device-bench-70b.sh strata|llama
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?strata|llama}
out=${OUT:-device-out}; mkdir -p "$out"
source tools/device-bin.sh
m=/root/m/llama3-70b-q4_0.gguf
mkdir -p /root/m
[ -f $bin/libggml-cuda.so ] || bash tools/device-restore-module.sh | tee "$out/module.txt"
f() { grep -v -e "^load_backend" -e "^ggml_cuda_init" -e "^  Device 0"; }
if [ ! -f "$m" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/machine.txt"
  df -h /root | tail -1 | tee -a "$out/machine.txt"; free -g | head -2 | tee -a "$out/machine.txt"
  $bin/strata-convert synth --preset llama3-70b --type q4_0 --vocab-from .carry/models/vocab-smollm2.gguf "$m" 2>&1 | tee "$out/synth.txt"
fi
case $stage in
  strata)
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 2048 -b 2048 -ub 2048 -n 16 -B 64 --batch-steps 4 -r 3 \
      --trace "$out/trace_70b_12g.json" 2>&1 | f | tee "$out/bench_strata_12g.txt"
    $bin/strata bench -m "$m" --device gpu -p 2048 -b 2048 -ub 2048 -n 128 -B 64 --batch-steps 4 -r 3 2>&1 | f | tee "$out/bench_strata_resident.txt"
    ;;
  llama)
    $bin/strata bench -m "$m" --device gpu --no-strata -p 2048 -b 2048 -ub 2048 -n 16 -B 64 --batch-steps 4 -r 3 --llama-ngl 24 2>&1 | f | tee "$out/bench_llama_24.txt"
    $bin/strata bench -m "$m" --device gpu --no-strata -p 2048 -b 2048 -ub 2048 -n 128 -B 64 --batch-steps 4 -r 3 --llama-ngl 99 2>&1 | f | tee "$out/bench_llama_99.txt"
    ;;
esac
