#!/usr/bin/env bash
# On the two-GPU machine (nvidia-h200-x2 / nvidia-h100-x2): the row split's
# big steps computed in two halves of rows, one half's outputs exchanged
# while the other computes (engine/rows.rs, issue 28). In one call:
#   1. CUDA parity of the row split against llama.cpp on 8 layers of the
#      8B shape (700M a GPU), with every prompt step cut in halves
#      (--row-halves 16) and with none (--row-halves 0);
#   2. the 70B-shaped Q4_0 at 12G on each GPU, pp2048, halves on (the
#      default) and off, interleaved over ROUNDS rounds (default 2), then
#      a trace of a halved prompt step (TRACE=1);
#   3. the same file on one GPU at 12G (the ratio's baseline).
# TESTS replaces the bench tests (default -p 2048 -b 2048 -ub 2048 -n 0
# -B 0 -r 3). Results in $OUT/halves.txt (and trace_70b_2x12g_halves.json.gz).
#   XZ_BIN=1 tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   TRACE=1 bash tools/device/row-halves.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
s8=$(dev_synth llama3-8b 8)
m=$(dev_synth llama3-70b)
dev_module_wait || exit 1
dev_keep_module
tests=${TESTS:-"-p 2048 -b 2048 -ub 2048 -n 0 -B 0 -r 3"}
f=$out/halves.txt
nvidia-smi topo -m > "$f" 2>&1
for h in 16 0; do
  echo "== strata check --split-mode row --row-halves $h (8 layers of the 8B shape, 700M a GPU)" | tee -a "$f"
  timeout 150 $bin/strata check -m "$s8" --device gpu --devices 0,1 --split-mode row --gpu-budget 700M \
    --hybrid off -n 16 --row-halves $h 2>&1 | quiet | tee -a "$f"
done
for r in $(seq ${ROUNDS:-2}); do
  for h in default 0; do
    echo "-- round $r: 12G on each of two GPUs, --split-mode row, row halves $h" | tee -a "$f"
    timeout 200 $bin/strata bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G --split-mode row $tests \
      $([ $h = default ] || echo "--row-halves $h") 2>&1 | quiet | grep -e "pp[0-9]" -e "tg[0-9]" -e batched -e rror | tee -a "$f"
  done
done
if [ -n "${TRACE:-}" ]; then
  echo "== traced: 12G on each of two GPUs, --split-mode row, row halves default" | tee -a "$f"
  timeout 200 $bin/strata bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G --split-mode row \
    -p 2048 -b 2048 -ub 2048 -n 0 -B 0 -r 2 --trace "$out/trace_70b_2x12g_halves.json" 2>&1 | quiet | tee -a "$f"
  gzip -f "$out/trace_70b_2x12g_halves.json"
fi
echo "== 12G on one GPU" | tee -a "$f"
timeout 180 $bin/strata bench -m "$m" --device gpu --devices 0 --gpu-budget 12G $tests 2>&1 | quiet |
  grep -e "pp[0-9]" -e "tg[0-9]" -e batched -e rror | tee -a "$f"
for g in machine.txt module.txt synth.txt; do
  [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
done
