#!/usr/bin/env bash
# The test command (README, CI): install what is needed, fetch the test
# models, check the vendored source, run every test. Tests needing a model
# fail rather than skip here (STRATA_REQUIRE_MODELS=1).
#   tools/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
tools/fetch-models.sh all >/dev/null
tools/serve-clients.sh >/dev/null
export STRATA_REQUIRE_MODELS=1
cargo build --release --all-targets
# the runtime alone: without the converter and llama.cpp's reference decoder
cargo check --release --no-default-features --lib --bins
vendor/verify.sh
cargo test --release -- --test-threads 1
