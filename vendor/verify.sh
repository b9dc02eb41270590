#!/usr/bin/env bash
# Checks that every file in vendor/ggml-src.tar.xz equals the pinned crate's
# copy (cargo's registry source), and the archive's recorded checksum.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
(cd "$here" && echo "$(cat ggml-src.tar.xz.sha256)  ggml-src.tar.xz" | sha256sum -c --quiet -)
ver=$(grep -A1 'name = "llama-cpp-sys-2"' "$here/../Cargo.lock" | sed -n 's/version = "\(.*\)"/\1/p')
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/llama-cpp-sys-2-"$ver"/llama.cpp | head -1)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf "$here/ggml-src.tar.xz"
n=0
while IFS= read -r f; do
  cmp -s "$tmp/$f" "$src/$f" || { echo "vendor/ggml-src.tar.xz: $f differs from llama-cpp-sys-2 $ver" >&2; exit 1; }
  n=$((n + 1))
done < <(cd "$tmp" && find ggml -type f)
echo "vendor: $n files match llama-cpp-sys-2 $ver"
