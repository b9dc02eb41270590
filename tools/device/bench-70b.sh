#!/usr/bin/env bash
# On the GPU machine: the 70B headline benchmark. The Llama-3-70B-shaped
# Q4_0 model (80 layers, written by strata-convert synth) at a 12 GB GPU
# budget and all resident, and llama.cpp on the same file at 24 layers and
# all layers; or a decode-sized 12 GB plan beside llama.cpp ngl=24.
#   tools/device/pack.sh VOCAB.gguf        (here), then on the device:
#   bash tools/device/bench-70b.sh strata   # 12G: pp2048, tg16, 64 sequences (trace); all resident: tg128
#   bash tools/device/bench-70b.sh llama    # llama.cpp ngl=24 and ngl=99, the same tests
#   bash tools/device/bench-70b.sh decode   # 12G, -b 64 -c 1536, SLOTS (default 3) slots: pp64, tg16,
#                                           # 8 and 64 sequences beside llama.cpp ngl=24 (trace)
# Several may be named in one call (default: strata). Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_70b || exit 1
for what in ${@:-strata}; do
case $what in
  strata)
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 2048 -b 2048 -ub 2048 -n 16 -B 64 --batch-steps 4 -r 3 \
      --trace "$out/trace_70b_12g.json" 2>&1 | quiet | tee "$out/bench_strata_12g.txt"
    $bin/strata bench -m "$m" --device gpu -p 2048 -b 2048 -ub 2048 -n 128 -B 64 --batch-steps 4 -r 3 2>&1 | quiet \
      | tee "$out/bench_strata_resident.txt"
    ;;
  llama)
    $bin/strata bench -m "$m" --device gpu --no-strata -p 2048 -b 2048 -ub 2048 -n 16 -B 64 --batch-steps 4 -r 3 \
      --llama-ngl 24 2>&1 | quiet | tee "$out/bench_llama_24.txt"
    $bin/strata bench -m "$m" --device gpu --no-strata -p 2048 -b 2048 -ub 2048 -n 128 -B 64 --batch-steps 4 -r 3 \
      --llama-ngl 99 2>&1 | quiet | tee "$out/bench_llama_99.txt"
    ;;
  decode)
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -b 64 -c 1536 --slots "${SLOTS:-3}" -p 64 -n 16 -B 8,64 \
      --batch-steps 4 -r 3 --llama-ngl 24 --trace "$out/trace_70b_decode.json" 2>&1 | quiet \
      | tee "$out/bench_70b_decode.txt"
    ;;
  *) echo "bench-70b.sh: unknown mode $what (strata, llama, decode)" >&2; exit 2 ;;
esac
done
