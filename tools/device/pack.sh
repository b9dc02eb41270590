#!/usr/bin/env bash
# Packs what a GPU machine without Rust needs into .carry/ (ignored by git,
# carried to the device): the stripped binaries (strata, strata-convert,
# readbench for tools/bench/fio-compare.sh), their shared libraries, a CPU
# backend module per x86 server generation, a cached CUDA module if
# .carry-cache/ holds one (its xz parts and stamp, as the device runs return
# them in $OUT/cuda/; saves the 4-minute build), Debian's fio in .carry/fio/
# (run it as .carry/fio/run-fio) if tools/device/fetch-fio.sh put it in
# .carry-cache/fio/, and the files given (into .carry/models/). Runs cargo.
#   tools/device/pack.sh [FILE...]          e.g. tools/device/pack.sh /tmp/vocab-smollm2.gguf
#   XZ_BIN=1 tools/device/pack.sh FILE...   .carry/bin packed as .carry/bin.tar.xz (18 MB down to
#                                           about 5, room for tools/device/build-old.sh binaries in
#                                           .carry/old/); tools/device/lib.sh unpacks it on the device
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .carry && mkdir -p .carry/bin .carry/models .carry/cuda
# the CPU modules of the server generations (x64, haswell, skylakex, icelake,
# zen4, sapphirerapids): ggml loads the best one the CPU supports
STRATA_CPU_VARIANTS=portable cargo build --release --bin strata --bin strata-convert --example readbench
strip -o .carry/bin/strata target/release/strata
strip -o .carry/bin/strata-convert target/release/strata-convert
strip -o .carry/bin/readbench target/release/examples/readbench
for f in libggml-base.so.0 libggml.so.0 libllama.so.0 libggml-rpc.so libggml-cpu-haswell.so libggml-cpu-skylakex.so \
    libggml-cpu-icelake.so libggml-cpu-sapphirerapids.so libggml-cpu-zen4.so; do
  strip --strip-debug -o .carry/bin/$f target/release/$f
done
[ -d .carry-cache ] && cp .carry-cache/libggml-cuda.so.* .carry/cuda/ 2>/dev/null || true
if [ -x .carry-cache/fio/bin/fio ]; then
  cp -r .carry-cache/fio .carry/fio
else
  echo "no fio in .carry-cache/fio (tools/device/fetch-fio.sh): the device scripts skip fio" >&2
fi
for m in "$@"; do cp "$m" .carry/models/; done
if [ "${XZ_BIN:-0}" = 1 ]; then
  tar -cJf .carry/bin.tar.xz -C .carry bin && rm -rf .carry/bin
fi
du -sh .carry
