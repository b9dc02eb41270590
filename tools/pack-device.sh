#!/usr/bin/env bash
# Packs what a GPU machine without Rust needs into .carry/ (ignored by git,
# carried to the device): the stripped binaries (strata, strata-convert), their
# shared libraries, one CPU backend module, a cached CUDA module if
# .carry-cache/ holds one (saves the 4-minute build), and the files given.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/bin .carry/models .carry/cuda
cargo build --release --bin strata --bin strata-convert
strip -o .carry/bin/strata target/release/strata
strip -o .carry/bin/strata-convert target/release/strata-convert
for f in libggml-base.so.0 libggml.so.0 libllama.so.0 libggml-cpu-haswell.so; do
  strip --strip-debug -o .carry/bin/$f target/release/$f
done
[ -d .carry-cache ] && cp .carry-cache/libggml-cuda.so.* .carry/cuda/ 2>/dev/null || true
for m in "$@"; do cp "$m" .carry/models/; done
du -sh .carry
