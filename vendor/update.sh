#!/usr/bin/env bash
# Regenerates vendor/ggml-src.tar.xz from the pinned llama-cpp-sys-2 crate
# source that cargo downloaded (run `cargo fetch` first), so the CUDA backend
# module can be built from exactly that source on a machine without Rust.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ver=$(grep -A1 'name = "llama-cpp-sys-2"' "$here/../Cargo.lock" | sed -n 's/version = "\(.*\)"/\1/p')
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/llama-cpp-sys-2-"$ver"/llama.cpp | head -1)
[ -d "$src/ggml" ] || { echo "error: crate source for llama-cpp-sys-2 $ver not found; run cargo fetch" >&2; exit 1; }
tar -C "$src" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
  --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-metal' \
  --exclude='ggml/src/ggml-cann' --exclude='ggml/src/ggml-musa' --exclude='ggml/src/ggml-opencl' \
  --exclude='ggml/src/ggml-webgpu' --exclude='ggml/src/ggml-hip' --exclude='ggml/src/ggml-zdnn' \
  --exclude='ggml/src/ggml-hexagon' --exclude='ggml/src/ggml-openvino' --exclude='ggml/src/ggml-virtgpu' \
  -cf - ggml | xz -9 -T1 > "$here/ggml-src.tar.xz"
sha256sum "$here/ggml-src.tar.xz" | cut -d' ' -f1 > "$here/ggml-src.tar.xz.sha256"
echo "vendor/ggml-src.tar.xz from llama-cpp-sys-2 $ver: $(cat "$here/ggml-src.tar.xz.sha256")"
