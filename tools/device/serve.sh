#!/usr/bin/env bash
# On the GPU machine: strata serve on the 70B-shaped Q4_0 model at a 12G GPU
# budget, 64 concurrent streaming clients (tools/bench/serve-bench.py), beside
# `strata bench -B 64` and llama.cpp's batched decode at ngl=24 (its default
# settings) in the same run.
#   tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/serve.sh          # CLIENTS (default 64), MAX_TOKENS (32), LLAMA_NGL (24),
#                                       # LLAMA_BEST=1: llama.cpp also under --no-mmap -ub 2048;
#                                       # SKIP_BENCH=1: the server alone
# Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_70b || exit 1
C=${CLIENTS:-64}; N=${MAX_TOKENS:-32}
{
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== 12G: strata bench, $C sequences x 8 decode steps after 16-token prompts; llama.cpp ngl=${LLAMA_NGL:-24}"
  $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -c 4096 -b 512 -p 0 -n 0 -B $C -r 2 \
    --llama-ngl ${LLAMA_NGL:-24} ${LLAMA_BEST:+--llama-best} 2>&1 | quiet
  fi
  echo "== 12G: strata serve --parallel $C, $C streaming clients, 16-token prompts, $N tokens each"
  $bin/strata serve -m "$m" --device gpu --gpu-budget 12G -c 4096 -b 512 --parallel $C --port 8080 \
    > "$out/serve_log.txt" 2>&1 &
  pid=$!
  get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8080$1').read().decode())"; }
  for i in $(seq 1 600); do get /health > /dev/null 2>&1 && break; sleep 0.5; done
  python3 tools/bench/serve-bench.py --url http://127.0.0.1:8080 --clients $C --prompt-tokens 16 --max-tokens $N \
    --vocab 49152 --json "$out/serve_bench.json"
  # a second round on the warm server
  python3 tools/bench/serve-bench.py --url http://127.0.0.1:8080 --clients $C --prompt-tokens 16 --max-tokens $N \
    --vocab 49152 --json "$out/serve_bench2.json"
  get /metrics | grep -v "^#" > "$out/serve_metrics.txt"
  kill -TERM $pid; wait $pid; echo "serve exit status $?"
  quiet < "$out/serve_log.txt" | head -8
} 2>&1 | tee "$out/serve.txt"
ls -la "$out"
