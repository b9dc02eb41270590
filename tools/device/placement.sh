#!/usr/bin/env bash
# On the GPU machine: which groups stay resident when not all fit
# (`--resident first`, the first layers', against `--resident spread`, as
# many of each kind spread through the layers), on the steps where the
# order matters (large steps: the bus idles while the first layers compute)
# and on decode (to see it costs nothing there).
#   tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/placement.sh dense   # 70B-shaped Q4_0 at 12G: pp512 (-ub 512) and tg16, both orders
#   bash tools/device/placement.sh moe     # Qwen3-30B-A3B shape in Q4_K_M at 8G: pp2048 (-ub 2048) and tg16
#   bash tools/device/placement.sh dense-big  # 70B at 12G: pp2048 (-ub 2048) and 64 sequences, both orders
# ORDERS="spread first spread first" runs those orders in that order (default: first spread; a
# repeated order shows the machine's drift); TRACE=1 writes a trace of each run (trace_MODE_ORDER_K.json);
# R sets the repetitions (dense: 3) and N the generated tokens (dense: 16); EXTRA adds bench flags
# (EXTRA=--json: every repetition's figure).
# Results under $OUT, one file per mode.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
case ${1:-dense} in
  dense|dense-big) m=$(dev_synth llama3-70b) ;;
  moe) m=$(TYPE=q4_k_m dev_synth qwen3-30b-a3b) ;;
  *) echo "placement.sh: unknown mode $1 (dense, dense-big, moe)" >&2; exit 2 ;;
esac
dev_module_wait || exit 1
k=0
for r in ${ORDERS:-first spread}; do
  k=$((k + 1))
  tr=()
  [ "${TRACE:-0}" = 1 ] && tr=(--trace "$out/trace_${1}_${r}_$k.json")
  echo "== --resident $r (run $k)" | tee -a "$out/placement_${1//-/_}.txt"
  case $1 in
    dense)
      timeout 200 $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 512 -b 512 -ub 512 -n ${N:-16} -B 0 -r ${R:-3} \
        --resident $r "${tr[@]}" ${EXTRA:-} 2>&1 | quiet | tee -a "$out/placement_dense.txt" ;;
    dense-big)
      timeout 200 $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 2048 -b 2048 -ub 2048 -n 0 -B 64 \
        --batch-steps 4 -r 2 --resident $r "${tr[@]}" 2>&1 | quiet | tee -a "$out/placement_dense_big.txt" ;;
    moe)
      timeout 150 $bin/strata bench -m "$m" --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 2048 -n 16 -B 0 \
        -r 3 --resident $r "${tr[@]}" 2>&1 | quiet | tee -a "$out/placement_moe.txt" ;;
  esac
done
