#!/usr/bin/env bash
# On the GPU machine (no Rust): build the CUDA module from vendor/, then check
# strata (CUDA) against llama.cpp (CUDA) and strata (CPU) on the carried
# small model. Results go to $OUT (or ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}; mkdir -p "$out"
source tools/device-bin.sh
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  nproc
} 2>&1 | tee "$out/machine.txt"
start=$(date +%s)
bash tools/build-cuda-module.sh "$bin" 90 2>&1 | tee "$out/build.txt" || exit 1
echo "module build: $(( $(date +%s) - start )) s" | tee -a "$out/build.txt"
for m in .carry/models/*.gguf; do
  $bin/strata check -m "$m" --device gpu --with-cpu -n 32 2>&1 | grep -v "^load_backend" | tee -a "$out/check.txt"
  $bin/strata run -m "$m" --device gpu -p "The capital of France is" -n 24 --temp 0 2>&1 | grep -v "^load_backend" | tee -a "$out/run.txt"
done
