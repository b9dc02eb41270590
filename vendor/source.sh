#!/usr/bin/env bash
# The source strata builds: vendor/llama.cpp.tar.xz (the pinned upstream
# source, unmodified) with the patches of vendor/patches/ applied in name
# order. Its identity names both, so a backend module built from another
# archive or another patch set is refused (see src/ggml/backend.rs).
#   vendor/source.sh id          prints the identity: the archive's sha256,
#                                then `+NAME:SHA` (12 hex digits) per patch
#   vendor/source.sh apply DIR   applies the patches to the archive unpacked in DIR
#   vendor/source.sh check       checks every patch applies to the archive
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
patches() { find "$here/patches" -maxdepth 1 -name '*.patch' 2>/dev/null | LC_ALL=C sort; }
case "${1:-}" in
  id)
    id=$(tr -d '[:space:]' < "$here/llama.cpp.tar.xz.sha256")
    while read -r p; do
      [ -n "$p" ] || continue
      id+="+$(basename "$p" .patch):$(sha256sum "$p" | cut -c1-12)"
    done < <(patches)
    echo "$id" ;;
  apply)
    dir=${2:?usage: source.sh apply DIR}
    while read -r p; do
      [ -n "$p" ] || continue
      patch -d "$dir" -p1 --quiet --forward --no-backup-if-mismatch < "$p" \
        || { echo "error: $(basename "$p") does not apply to $dir" >&2; exit 1; }
    done < <(patches) ;;
  check)
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    tar -C "$tmp" -xJf "$here/llama.cpp.tar.xz"
    "$0" apply "$tmp"
    echo "vendor: $(patches | wc -l) patch(es) apply to llama.cpp.tar.xz" ;;
  *) echo "usage: source.sh id | apply DIR | check" >&2; exit 2 ;;
esac
