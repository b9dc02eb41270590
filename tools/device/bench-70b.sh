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
#   bash tools/device/bench-70b.sh batch64  # 12G, 64 sequences: the plan's hybrid split of 64-token steps
#                                           # against --hybrid off (every 64-token step on the bus)
#   bash tools/device/bench-70b.sh kv32k    # 12G, 32k context, KV tiered, decode beside llama.cpp with its
#                                           # default KV placement (ngl=${KV_NGL:-19}, a list allowed: weights
#                                           # and KV of its layers on the GPU; 19 is the most under 12 GB) and
#                                           # with -nkvo (ngl=${NKVO_NGL:-26}), each with its defaults and with
#                                           # --no-mmap -ub 2048 (--llama-best)
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
  batch64)
    for h in auto off; do
      timeout 240 $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 0 -B 64 --batch-steps 4 -r 2 \
        --hybrid $h 2>&1 | quiet | tee -a "$out/bench_70b_batch64.txt"
    done
    ;;
  kv32k)
    timeout 330 $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --kv-budget 0 -c 32768 --depth 32000 \
      -p 0 -n 8 -B 0 -r 2 --llama-ngl "${KV_NGL:-19}" --llama-best 2>&1 | quiet | tee "$out/bench_70b_kv32k.txt"
    timeout 200 $bin/strata bench -m "$m" --device gpu --no-strata -c 32768 --depth 32000 \
      -p 0 -n 8 -B 0 -r 2 --llama-ngl "${NKVO_NGL:-26}" --llama-nkvo --llama-best 2>&1 | quiet \
      | tee -a "$out/bench_70b_kv32k.txt"
    ;;
  *) echo "bench-70b.sh: unknown mode $what (strata, llama, decode, batch64, kv32k)" >&2; exit 2 ;;
esac
done
