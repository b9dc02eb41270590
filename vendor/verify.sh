#!/usr/bin/env bash
# Checks that vendor/llama.cpp.tar.xz (and llama-common.tar.xz) is the pinned upstream source,
# unmodified: its checksum equals the recorded one and PINNED.md's, and
# (unless --offline) it equals, byte for byte, the archive vendor/update.sh
# makes afresh from the pinned crate on crates.io; and that every patch of
# vendor/patches/ applies to it and is named in PINNED.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for a in llama.cpp llama-common; do
  sum=$(cat "$here/$a.tar.xz.sha256")
  got=$(sha256sum "$here/$a.tar.xz" | cut -d' ' -f1)
  [ "$got" = "$sum" ] || { echo "vendor/$a.tar.xz: sha256 $got, recorded $sum" >&2; exit 1; }
  grep -q "$sum" "$here/PINNED.md" || { echo "vendor/PINNED.md does not name $a.tar.xz's sha256 $sum" >&2; exit 1; }
done
sum=$(cat "$here/llama.cpp.tar.xz.sha256")
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
for a in llama.cpp llama-common; do
  cmp -s "$tmp/$a.tar.xz" "$here/$a.tar.xz" \
    || { echo "vendor/$a.tar.xz differs from what vendor/update.sh makes from llama-cpp-sys-2 $ver" >&2; exit 1; }
done
echo "vendor: llama.cpp.tar.xz and llama-common.tar.xz are llama-cpp-sys-2 $ver's llama.cpp, unmodified ($sum)"
