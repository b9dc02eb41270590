#!/usr/bin/env bash
# Regenerates vendor/llama.cpp.tar.xz: the ggml and llama.cpp source strata
# builds (build.rs of ffi/) and binds (ffi/src/bindings.rs), taken from the
# llama.cpp tree vendored by one published llama-cpp-sys-2 crate, downloaded
# from crates.io and checked against the crate checksum given here; and
# vendor/llama-common.tar.xz: the few files of the same tree's common/
# library strata compiles (its JSON-schema-to-grammar converter, with the
# JSON reader it uses and nlohmann's header), kept apart so that the backend
# modules' identity (vendor/source.sh, the main archive) does not change
# with them.
#   vendor/update.sh VERSION CRATE_SHA256 [DIR]      (DIR: where to write; vendor/)
# After an update: the table in PINNED.md, ffi/regen-bindings.sh, the parity
# tests. The archive is reproducible (sorted, fixed times and owners), which
# vendor/verify.sh relies on.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ver=${1:?usage: vendor/update.sh VERSION CRATE_SHA256}
want=${2:?usage: vendor/update.sh VERSION CRATE_SHA256}
dest=${3:-$here}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
curl -sSfL -o "$tmp/crate.tar.gz" "https://static.crates.io/crates/llama-cpp-sys-2/llama-cpp-sys-2-$ver.crate"
got=$(sha256sum "$tmp/crate.tar.gz" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "error: llama-cpp-sys-2 $ver has sha256 $got, not $want" >&2; exit 1; }
tar -C "$tmp" -xzf "$tmp/crate.tar.gz"
src="$tmp/llama-cpp-sys-2-$ver/llama.cpp"
# what a CPU + CUDA build of libggml*, the backend modules and libllama reads;
# the other backends, the tools, common/, the tests and the header-only
# libraries only they use are left out (their CMakeLists stay: the top one
# adds them unconditionally)
tar -C "$src" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
  --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-metal' \
  --exclude='ggml/src/ggml-cann' --exclude='ggml/src/ggml-musa' --exclude='ggml/src/ggml-opencl' \
  --exclude='ggml/src/ggml-webgpu' --exclude='ggml/src/ggml-hip' --exclude='ggml/src/ggml-zdnn' \
  --exclude='ggml/src/ggml-hexagon' --exclude='ggml/src/ggml-openvino' --exclude='ggml/src/ggml-virtgpu' \
  --exclude='vendor/cpp-httplib' --exclude='vendor/miniaudio/*.h' --exclude='vendor/nlohmann/*.hpp' \
  --exclude='vendor/stb/*.h' --exclude='vendor/sheredom/*.h' \
  -cf - CMakeLists.txt LICENSE cmake include src ggml vendor | xz -9e -T1 > "$dest/llama.cpp.tar.xz"
sha256sum "$dest/llama.cpp.tar.xz" | cut -d' ' -f1 > "$dest/llama.cpp.tar.xz.sha256"
echo "$dest/llama.cpp.tar.xz from llama-cpp-sys-2 $ver: $(cat "$dest/llama.cpp.tar.xz.sha256")"
tar -C "$src" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - \
  common/common.h common/json-schema-to-grammar.cpp common/json-schema-to-grammar.h \
  common/json-schema.cpp common/json-schema.h common/json.cpp common/json.h common/trie.cpp common/trie.h \
  common/unicode.cpp common/unicode.h vendor/nlohmann/json.hpp vendor/nlohmann/json_fwd.hpp LICENSE \
  | xz -9e -T1 > "$dest/llama-common.tar.xz"
sha256sum "$dest/llama-common.tar.xz" | cut -d' ' -f1 > "$dest/llama-common.tar.xz.sha256"
echo "$dest/llama-common.tar.xz from llama-cpp-sys-2 $ver: $(cat "$dest/llama-common.tar.xz.sha256")"
