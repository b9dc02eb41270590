#!/usr/bin/env bash
# Checks that vendor/llama.cpp.tar.xz is the pinned upstream source,
# unmodified: its checksum equals the recorded one and PINNED.md's, and
# (unless --offline) it equals, byte for byte, the archive vendor/update.sh
# makes afresh from the pinned crate on crates.io; and that every patch of
# vendor/patches/ applies to it and is named in PINNED.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sum=$(cat "$here/llama.cpp.tar.xz.sha256")
got=$(sha256sum "$here/llama.cpp.tar.xz" | cut -d' ' -f1)
[ "$got" = "$sum" ] || { echo "vendor/llama.cpp.tar.xz: sha256 $got, recorded $sum" >&2; exit 1; }
grep -q "$sum" "$here/PINNED.md" || { echo "vendor/PINNED.md does not name the archive's sha256 $sum" >&2; exit 1; }
for p in "$here"/patches/*.patch; do
  [ -e "$p" ] || continue
  grep -q "$(basename "$p")" "$here/PINNED.md" || { echo "vendor/PINNED.md does not name $(basename "$p")" >&2; exit 1; }
done
bash "$here/source.sh" check
[ "${1:-}" = "--offline" ] && { echo "vendor: llama.cpp.tar.xz matches its checksum"; exit 0; }
row=$(grep '^| crate `llama-cpp-sys-2`' "$here/PINNED.md")
ver=$(echo "$row" | sed -n 's/.*| `\([0-9.]*\)` |.*/\1/p')
crate_sum=$(echo "$row" | grep -o '[0-9a-f]\{64\}')
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
bash "$here/update.sh" "$ver" "$crate_sum" "$tmp" >/dev/null
cmp -s "$tmp/llama.cpp.tar.xz" "$here/llama.cpp.tar.xz" \
  || { echo "vendor/llama.cpp.tar.xz differs from what vendor/update.sh makes from llama-cpp-sys-2 $ver" >&2; exit 1; }
echo "vendor: llama.cpp.tar.xz is llama-cpp-sys-2 $ver's llama.cpp, unmodified ($sum)"
