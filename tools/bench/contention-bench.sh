#!/usr/bin/env bash
# Decode on the CPU while another process keeps one core busy (a `yes`
# loop), strata beside llama.cpp (its decoder through libllama, default
# settings) at the same thread counts, in the same minutes; then the same
# without the competitor. Medians of `strata bench` (tg128, 3 repetitions).
#   tools/bench/contention-bench.sh [MODEL]    (default Qwen2.5-Coder-1.5B Q4_K_M; needs target/release/strata)
set -uo pipefail
cd "$(dirname "$0")/../.."
m=${1:-$HOME/.cache/strata/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf}
b=target/release/strata
run() {  # label, then bench flags
  local label=$1; shift
  $b bench -m "$m" --device cpu -c 512 -p 0 -n 128 -B 0 -r 3 --llama-ngl 0 "$@" 2>&1 \
    | grep -E "^(strata|llama\.cpp)|CPU threads at the end" | grep -E "tg128|threads" | sed "s/^/$label  /"
}
echo "machine: $(nproc) cores; model $(basename "$m")"
yes > /dev/null & busy=$!
trap 'kill $busy 2>/dev/null' EXIT
for t in 1 2; do
  for poll in 50 0; do run "busy  -t $t --poll $poll" -t $t --poll $poll; done
done
run "busy  default (tuned)" --poll 50
kill $busy; wait $busy 2>/dev/null
for t in 1 2; do run "idle  -t $t --poll 50" -t $t --poll 50; done
run "idle  default (tuned)" --poll 50
