#!/usr/bin/env bash
# On the GPU machine: does ggml-cuda's fused top-k-MoE kernel explain the
# CUDA parity gap on prompts over 8 tokens (issue 26)? strata check on the
# Qwen3-30B-A3B shape as built, then with every ggml-cuda fusion off in both
# engines (GGML_CUDA_DISABLE_FUSION=1). Then the modes given to zoo.sh.
#   bash tools/device/moe-fusion.sh [ZOO_MODE...]
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
s=$(dev_synth qwen3-30b-a3b)
dev_module_wait || exit 1
for fusion in on off; do
  if [ $fusion = off ]; then export GGML_CUDA_DISABLE_FUSION=1; fi
  echo "== ggml-cuda fusion $fusion"
  timeout 150 $bin/strata check -m "$s" --device gpu --gpu-budget 8G --hybrid off -n 16 2>&1 | quiet
done 2>&1 | tee "$out/moe_fusion.txt"
unset GGML_CUDA_DISABLE_FUSION
rm -f "$s"
[ $# -gt 0 ] && bash tools/device/zoo.sh "$@"
