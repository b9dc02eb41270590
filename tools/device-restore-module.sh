#!/usr/bin/env bash
# Restores a CUDA module carried in .carry/cuda (xz parts + stamp), or builds it.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/device-bin.sh
if ls .carry/cuda/libggml-cuda.so.xz.part-* >/dev/null 2>&1; then
  cat .carry/cuda/libggml-cuda.so.xz.part-* | xz -d > .carry/bin/libggml-cuda.so
  cp .carry/cuda/libggml-cuda.so.ggml-version .carry/bin/
  echo "restored libggml-cuda.so from .carry/cuda ($(cat .carry/bin/libggml-cuda.so.ggml-version | paste -sd' '))"
else
  bash tools/build-cuda-module.sh .carry/bin 90
fi
