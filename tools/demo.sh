#!/usr/bin/env bash
# Quick start: install what is needed, fetch the small default model
# (SmolLM2-135M-Instruct), build strata and generate text with it. The
# model downloads while the build compiles, and only the `strata` binary is
# built (the converter and the tests are built by tools/test.sh).
#   tools/demo.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
fetched=$(mktemp)
trap 'rm -f "$fetched"' EXIT
tools/fetch-models.sh smollm2 >"$fetched" &
fetch=$!
cargo build --release --quiet --bin strata
wait "$fetch" || { echo "error: fetching the model failed (tools/fetch-models.sh smollm2)" >&2; exit 1; }
model=$(cat "$fetched")
exec ./target/release/strata run -m "$model" -n 64 --temp 0 -p "${1:-The three most important things about memory hierarchies are}"
