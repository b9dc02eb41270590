#!/usr/bin/env bash
# The source strata builds: vendor/llama.cpp.tar.xz (the pinned upstream
# source, unmodified) with the patches of vendor/patches/ applied in name
# order. Its identity names both, so a backend module built from another
# archive or another patch set is refused (see src/ggml/backend.rs).
#   vendor/source.sh id          prints the identity: the archive's sha256,
#                                then `+NAME:SHA` (12 hex digits) per patch
#   vendor/source.sh id cuda     the CUDA module's identity: the same, naming
#                                only the patches that touch a file it is
#                                built from (not the CPU backend's
#                                ggml/src/ggml-cpu/, nor libllama's src/), so
#                                a CPU-only patch leaves a built module valid
#   vendor/source.sh apply DIR   applies the patches to the archive unpacked in DIR
#   vendor/source.sh check       checks every patch applies to the archive
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
patches() { find "$here/patches" -maxdepth 1 -name '*.patch' 2>/dev/null | LC_ALL=C sort; }
# whether patch $1 touches a file of the CUDA module's build: a path its
# diff writes outside ggml/src/ggml-cpu/ and outside libllama's src/
touches_cuda() {
  awk '/^\+\+\+ / && $2 !~ /^b\/ggml\/src\/ggml-cpu\// && $2 !~ /^b\/src\// { f = 1 } END { exit !f }' "$1"
}
case "${1:-}" in
  id)
    case "${2:-}" in ""|cuda) ;; *) echo "usage: source.sh id [cuda]" >&2; exit 2 ;; esac
    id=$(tr -d '[:space:]' < "$here/llama.cpp.tar.xz.sha256")
    while read -r p; do
      [ -n "$p" ] || continue
      if [ "${2:-}" = cuda ] && ! touches_cuda "$p"; then continue; fi
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
  *) echo "usage: source.sh id [cuda] | apply DIR | check" >&2; exit 2 ;;
esac
