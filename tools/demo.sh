#!/usr/bin/env bash
# Quick start: install what is needed, fetch the small default model
# (SmolLM2-135M-Instruct), build strata and generate text with it.
#   tools/demo.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
model=$(tools/fetch-models.sh smollm2)
cargo build --release --quiet
exec ./target/release/strata run -m "$model" -n 64 --temp 0 -p "${1:-The three most important things about memory hierarchies are}"
