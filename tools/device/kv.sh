#!/usr/bin/env bash
# On the GPU machine: the tiered KV cache (issue 7).
# 1. Correctness on CUDA: strata with every layer's KV windowed through host
#    memory (and weights streamed, slots poisoned), half the layers' KV on
#    the device, and three sequences taking turns through spill files,
#    against llama.cpp's CUDA path, on a small synthetic model.
# 2. Decode at a 32k-token context on the 70B-shaped model at a 12 GB GPU
#    budget, all KV tiered (--kv-budget 0), beside llama.cpp keeping its KV
#    in host memory (-nkvo) at about the same GPU memory. Both caches are
#    filled to 32000 tokens without computing them (strata: fill_synthetic;
#    llama.cpp: a sequence state loaded with llama_state_seq_set_data).
#   tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/kv.sh            # NGL=26: llama.cpp's layers (default 24); SKIP_70B=1: part 1 only
# Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
s8=$(dev_synth llama3-8b 8)
dev_module_wait || exit 1
{
  echo "== llama3-8b (8 layers): all KV windowed, vs llama.cpp CUDA"
  $bin/strata check -m $s8 --device gpu -n 16 -c 2048 --kv-budget 0 2>&1 | quiet
  echo "== the same with weights streamed and slots and KV windows poisoned"
  $bin/strata check -m $s8 --device gpu -n 16 -c 2048 --kv-budget 0 --stream-all --poison-slots 2>&1 | quiet
  echo "== half the layers' KV on the device (8 MiB each), 64-cell blocks"
  $bin/strata check -m $s8 --device gpu -n 16 -c 2048 --kv-budget 32M --kv-block 64 2>&1 | quiet
  echo "== 3 sequences taking turns, DRAM for 6 blocks of 16 cells: blocks go through spill files"
  $bin/strata check -m $s8 --device gpu -n 48 -c 2048 --kv-budget 0 --kv-block 16 --kv-dram 3M \
    --kv-spill-dir /root --turns 2 2>&1 | quiet
  echo "== the same with weights streamed and slots and KV windows poisoned"
  $bin/strata check -m $s8 --device gpu -n 48 -c 2048 --kv-budget 0 --kv-block 16 --kv-dram 3M \
    --kv-spill-dir /root --turns 2 --stream-all --poison-slots 2>&1 | quiet
} | tee "$out/check_kv.txt"
[ "${SKIP_70B:-0}" = 1 ] && exit 0
m=$(dev_synth llama3-70b)
NGL=${NGL:-24}
{
  echo "== 70B q4_0, 12G GPU budget, KV tiered, 32k context; llama.cpp -nkvo ngl=$NGL"
  $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --kv-budget 0 -c 32768 --depth 32000 \
    -p 0 -n 8 -B 0 -r 2 --llama-ngl "$NGL" --llama-nkvo --trace "$out/trace-kv32k.json" 2>&1 | quiet
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
} | tee "$out/bench_kv32k.txt"
