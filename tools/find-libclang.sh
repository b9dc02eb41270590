#!/usr/bin/env bash
# Prints the path of a libclang shared library that bindgen (through
# clang-sys, runtime loading) would load, or exits 1 if there is none.
#
# Mirrors clang-sys 1.9's search on Linux: $LIBCLANG_PATH, then the
# directories below, files named libclang.so, libclang-*.so, libclang.so.*
# or libclang-*.so.*, skipping libclang-cpp (LLVM's C++ library, which
# Debian installs with llvm-*-dev but which is not the C API bindgen needs).
#
#   STRATA_LIBCLANG_ROOT=DIR  search under DIR instead of / (tests)
set -uo pipefail
root="${STRATA_LIBCLANG_ROOT:-}"
dirs=()
[ -n "${LIBCLANG_PATH:-}" ] && dirs+=("$LIBCLANG_PATH")
shopt -s nullglob
for pattern in "/usr/local/llvm*/lib*" "/usr/local/lib*/*/*" "/usr/local/lib*/*" "/usr/local/lib*" \
               "/usr/lib*/*/*" "/usr/lib*/*" "/usr/lib*"; do
  for d in $root$pattern; do [ -d "$d" ] && dirs+=("$d"); done
done
for d in "${dirs[@]}"; do
  for f in "$d"/libclang.so "$d"/libclang-*.so "$d"/libclang.so.* "$d"/libclang-*.so.*; do
    case "$(basename "$f")" in *-cpp.*) continue ;; esac
    [ -e "$f" ] && { echo "$f"; exit 0; }
  done
done
exit 1
