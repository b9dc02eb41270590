#!/usr/bin/env bash
# Regenerates ffi/src/bindings.rs with bindgen (needs libclang: Debian's
# libclang-dev) from the vendored headers and ffi/wrapper.h. Run it after
# vendor/update.sh or a change to the shim's header; --check only reports
# whether the committed file is current.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p strata-ffi --features bindgen
new=$(ls -t target/release/build/strata-ffi-*/out/bindings.rs | head -1)
if [ "${1:-}" = "--check" ]; then
  cmp -s "$new" ffi/src/bindings.rs || { echo "ffi/src/bindings.rs is stale: run ffi/regen-bindings.sh" >&2; exit 1; }
  echo "ffi/src/bindings.rs is current"
else
  cp "$new" ffi/src/bindings.rs
  echo "ffi/src/bindings.rs regenerated from $new"
fi
