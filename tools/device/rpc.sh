#!/usr/bin/env bash
# On the GPU machine: ggml's RPC backend beside the local GPU (issue 28).
# `strata rpc-server --device gpu` on 127.0.0.1 offers the GPU; strata then
# computes on it through RPC (--device rpc --rpc 127.0.0.1:PORT) and
# directly (--device gpu), on the Llama-3-8B-shaped synthetic Q4_0 model:
# CUDA parity through RPC (strata check against llama.cpp on the GPU), then
# pp512 and tg16 both ways, all resident and at a 3G budget (streamed groups
# cross the loopback socket at every step).
#   tools/device/pack.sh VOCAB.gguf        (here), then on the device:
#   bash tools/device/rpc.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
m=$(dev_synth llama3-8b)
dev_module_wait || exit 1
dev_keep_module
port=50052
$bin/strata rpc-server --device gpu --port $port > "$out/rpc_server.txt" 2>&1 &
srv=$!
trap 'kill $srv 2>/dev/null' EXIT
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
f=$out/rpc.txt
echo "== strata devices --rpc 127.0.0.1:$port" | tee "$f"
timeout 60 $bin/strata devices --rpc 127.0.0.1:$port 2>&1 | quiet | tee -a "$f"
echo "== strata check --device rpc (llama.cpp on the GPU directly)" | tee -a "$f"
timeout 200 $bin/strata check -m "$m" --device rpc --rpc 127.0.0.1:$port -n 16 2>&1 | quiet | tee -a "$f"
for b in "" "--gpu-budget 3G"; do
  for d in gpu rpc; do
    echo "== strata bench --device $d ${b:-(all resident)}" | tee -a "$f"
    timeout 240 $bin/strata bench -m "$m" --device $d --rpc 127.0.0.1:$port $b -p 512 -n 16 -B 0 -r 2 \
      2>&1 | quiet | tee -a "$f"
  done
done
