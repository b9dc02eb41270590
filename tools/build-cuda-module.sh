#!/usr/bin/env bash
# Builds the ggml CUDA backend module (libggml-cuda.so) from vendor/llama.cpp.tar.xz
# with vendor/patches/ applied, the exact source the strata binary was built from, and installs it next to
# the strata binary with a version stamp (strata refuses a module whose stamp
# names another source). Used on a GPU machine without Rust, and by
# `cargo build --features cuda` (ffi/build.rs), so both build it alike.
#   tools/build-cuda-module.sh DEST_DIR [CUDA_ARCHS]     (default archs: 90)
# STRATA_CUDA_BUILD: the build directory, kept between calls (default
# /root/strata-cuda-build).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:?usage: build-cuda-module.sh DEST_DIR [CUDA_ARCHS]}
archs=${2:-90}
work=${STRATA_CUDA_BUILD:-/root/strata-cuda-build}
(cd "$root/vendor" && echo "$(cat llama.cpp.tar.xz.sha256)  llama.cpp.tar.xz" | sha256sum -c --quiet -) \
  || { echo "error: vendor/llama.cpp.tar.xz does not match its checksum" >&2; exit 1; }
# the archive with vendor/patches/ applied, as ffi/build.rs unpacks it; the
# stamp names the patches the module is built from (source.sh id cuda)
id=$(bash "$root/vendor/source.sh" id)
cuda_id=$(bash "$root/vendor/source.sh" id cuda)
mkdir -p "$work"
if [ "$(cat "$work/src.id" 2>/dev/null)" != "$id" ]; then
  rm -rf "$work/src" "$work/build" "$work/src.id"
  mkdir -p "$work/src"
  tar -C "$work/src" -xJf "$root/vendor/llama.cpp.tar.xz"
  bash "$root/vendor/source.sh" apply "$work/src"
  echo "$id" > "$work/src.id"
fi
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$work/src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF -DGGML_CPU=OFF -DGGML_OPENMP=OFF \
  -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_ARCHITECTURES="$archs" \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target ggml-cuda -j "$(nproc)" >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }
mod=$(find "$work/build" -name 'libggml-cuda.so' | head -1)
[ -n "$mod" ] || { echo "error: libggml-cuda.so was not produced" >&2; exit 1; }
mkdir -p "$dest"
cp "$mod" "$dest/.libggml-cuda.so.tmp" && mv "$dest/.libggml-cuda.so.tmp" "$dest/libggml-cuda.so"
ver=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$work/src/ggml/CMakeLists.txt" | paste -sd.)
printf "%s\n%s\n" "$ver" "$cuda_id" > "$dest/libggml-cuda.so.ggml-version"
echo "built $dest/libggml-cuda.so (ggml $ver, sm_$archs)"
