#!/usr/bin/env bash
# On the GPU machine: the architectures beyond Llama at real shapes (issue
# 26), each on its synthetic Q4_0 model: CUDA parity against llama.cpp all
# on the GPU at a budget that streams at least half of the groups, then
# `strata bench` beside llama.cpp at less GPU memory (its defaults and
# --no-mmap -ub 2048).
#   tools/device/pack.sh VOCAB.gguf        (here), then on the device:
#   bash tools/device/zoo.sh qwen3      # Qwen3-32B shape (17.5 GB): 8G budget; llama.cpp ngl=20
#   bash tools/device/zoo.sh qwen3-check  # its CUDA parity with --hybrid off at 8G, and all resident
# Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module || exit 1
for what in ${@:-qwen3}; do
case $what in
  qwen3)
    s=$(dev_synth qwen3-32b)
    timeout 200 $bin/strata check -m "$s" --device gpu --gpu-budget 8G -n 16 2>&1 | quiet | tee "$out/zoo_qwen3_check.txt"
    timeout 330 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -p 512 -n 16 -B 0 -r 2 --llama-ngl 20 --llama-best \
      2>&1 | quiet | tee "$out/zoo_qwen3_bench.txt"
    ;;
  qwen3-check)
    # CUDA parity without the host CPU's groups (hybrid decode computes
    # some FFN groups on the CPU, whose kernels round differently), streamed
    # and all resident
    s=$(dev_synth qwen3-32b)
    timeout 200 $bin/strata check -m "$s" --device gpu --gpu-budget 8G --hybrid off -n 16 2>&1 | quiet \
      | tee "$out/zoo_qwen3_check_nohybrid.txt"
    timeout 200 $bin/strata check -m "$s" --device gpu -n 16 2>&1 | quiet | tee "$out/zoo_qwen3_check_resident.txt"
    ;;
  *) echo "zoo.sh: unknown mode $what (qwen3, qwen3-check)" >&2; exit 2 ;;
esac
done
