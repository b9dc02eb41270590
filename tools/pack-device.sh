#!/usr/bin/env bash
# Packs what a GPU machine without Rust needs into .carry/ (ignored by git,
# carried to the device): the stripped strata binaries, their shared
# libraries, one CPU backend module, and small models.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/bin .carry/models
cargo build --release --bins
for f in strata strata-convert; do
  [ -f target/release/$f ] && strip -o .carry/bin/$f target/release/$f
done
for f in libggml-base.so.0 libggml.so.0 libllama.so.0 libggml-cpu-haswell.so; do
  strip --strip-debug -o .carry/bin/$f target/release/$f
done
for m in "$@"; do cp "$m" .carry/models/; done
du -sh .carry
