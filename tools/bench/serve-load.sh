#!/usr/bin/env bash
# The server under load with and without abusive clients beside it (issue
# 29): starts `strata serve` on SmolLM2 (CPU, --parallel 8), runs
# tools/bench/serve-load.py without, then with, the abusive clients, and
# stops the server. Same server, same minutes; figures in BENCHMARKS.md.
#   tools/bench/serve-load.sh [MODEL] [REQUESTS]   (default SmolLM2-135M Q4_1, 400; needs target/release/strata)
set -uo pipefail
cd "$(dirname "$0")/../.."
m=${1:-$HOME/.cache/strata/models/SmolLM2-135M-Instruct.Q4_1.gguf}
n=${2:-400}
port=$((20000 + RANDOM % 20000))
target/release/strata serve -m "$m" --device cpu --port $port --parallel 8 -c 8192 2>/tmp/serve-load.log &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.5
done
echo "machine: $(nproc) cores; model $(basename "$m"); strata serve --parallel 8 -c 8192 (pid $pid)"
rc=0
for abuse in "" --abuse; do
  python3 tools/bench/serve-load.py --url "http://127.0.0.1:$port" --pid $pid --requests "$n" $abuse || rc=1
done
exit $rc
