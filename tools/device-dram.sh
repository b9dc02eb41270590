#!/usr/bin/env bash
# On the GPU machine: the DRAM tier. Correctness of a small synthetic model
# streamed through a DRAM window on CUDA, then the 70B-shaped model at a 12 GB
# GPU budget and an 18 GB DRAM budget (about half the model), beside an
# O_DIRECT sequential read of the same file (dd; fio is not installed there).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}; mkdir -p "$out"
bin=.carry/bin; v=.carry/models/vocab-smollm2.gguf
mkdir -p /root/m
[ -f $bin/libggml-cuda.so ] || bash tools/device-restore-module.sh | tee "$out/module.txt"
f() { grep -v -e "^load_backend" -e "^ggml_cuda_init" -e "^  Device 0"; }
s8=/root/m/llama3-8b-8.gguf
[ -f $s8 ] || $bin/strata-convert synth --preset llama3-8b --type q4_0 --layers 8 --vocab-from $v $s8 >/dev/null
{
  echo "== llama3-8b (8 layers), every group streamed, DRAM window of 600M"
  $bin/strata check -m $s8 --device gpu --with-cpu -n 16 -c 512 --stream-all --dram-budget 600M 2>&1 | f
} | tee "$out/check_dram.txt"
m=/root/m/llama3-70b-q4_0.gguf
[ -f "$m" ] || $bin/strata-convert synth --preset llama3-70b --type q4_0 --vocab-from $v "$m" | tail -1 | tee "$out/synth.txt"
{
  echo "== O_DIRECT sequential read, dd bs=4M, 8 GiB"
  dd if="$m" of=/dev/null bs=4M iflag=direct count=2048 2>&1 | tail -1
  echo "== strata 12G GPU budget, 18G DRAM budget"
  $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --dram-budget 18G -b 64 -c 1536 -p 64 -n 4 -B 8 --batch-steps 1 -r 1 2>&1 | f
} | tee "$out/bench_dram.txt"
