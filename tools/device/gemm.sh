#!/usr/bin/env bash
# On the GPU machine: big steps through dequantize + BF16 GEMM (issue 30) on
# the Llama-3-70B-shaped Q4_0 model, each engine's GPU memory printed.
#   tools/device/pack.sh VOCAB.gguf        (here), then on the device:
#   bash tools/device/gemm.sh probe     # strata at 12G and all resident, --gemm auto (the probe's table in the log)
#   bash tools/device/gemm.sh compare   # 12G: strata --gemm auto and off, llama.cpp ngl=20 defaults and best
#                                       # (--no-mmap -ub 2048): pp2048, tg16
#   bash tools/device/gemm.sh resident  # all resident: strata --gemm auto and off, llama.cpp ngl=99 defaults: pp2048, tg16
#   bash tools/device/gemm.sh pp512     # 12G: strata --gemm auto, pp512 against the plan's floor
#   bash tools/device/gemm.sh pp512both # 12G: pp512 with --gemm auto and off, a trace of each
#   bash tools/device/gemm.sh parity    # `strata check` on an 8-layer Llama-3-8B shape, all on the GPU:
#                                       # --gemm 4 (every prompt step through GEMM) and --gemm off, llama.cpp beside
#   bash tools/device/gemm.sh batch     # 12G: 64 sequences, strata against llama.cpp ngl=20 defaults and best
#   bash tools/device/gemm.sh best99    # all resident: strata against llama.cpp ngl=99, defaults and best
#   bash tools/device/gemm.sh decode24  # 24G: tg16 (default -ub 512 plan), llama.cpp ngl=44 defaults beside
#   bash tools/device/gemm.sh headline  # the headline rows a placement change moves, in one call: pp512,
#                                       # compare12 (compare without --gemm off), batch, decode24
# Several may be named in one call (default: probe). Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_70b || exit 1
b=(bench -m "$m" --device gpu -p 2048 -b 2048 -ub 2048 -n 16 -B 0)
modes=${*:-probe}
modes=${modes//headline/pp512 compare12 batch decode24}
for what in $modes; do
case $what in
  probe)
    $bin/strata -v "${b[@]}" --gpu-budget 12G -r 2 2>&1 | quiet | tee "$out/gemm_probe_12g.txt"
    ;;
  compare|compare12)
    $bin/strata "${b[@]}" --gpu-budget 12G -r 2 --llama-ngl 20 --llama-best 2>&1 | quiet | tee "$out/gemm_compare_12g.txt"
    [ "$what" = compare ] &&
      $bin/strata "${b[@]}" --gpu-budget 12G -r 2 --gemm off 2>&1 | quiet | tee "$out/gemm_off_12g.txt"
    ;;
  resident)
    $bin/strata "${b[@]}" -r 2 --llama-ngl 99 2>&1 | quiet | tee "$out/gemm_resident.txt"
    $bin/strata "${b[@]}" -r 2 --gemm off 2>&1 | quiet | tee "$out/gemm_off_resident.txt"
    ;;
  pp512)
    $bin/strata -v bench -m "$m" --device gpu --gpu-budget 12G -p 512 -b 512 -ub 512 -n 0 -B 0 -r 3 \
      2>&1 | quiet | tee "$out/gemm_pp512_12g.txt"
    ;;
  pp512both)
    # GEMM and ggml's kernels at 512 rows, each with a trace of its steps
    for g in auto off; do
      $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 512 -b 512 -ub 512 -n 0 -B 0 -r 3 --gemm $g \
        --trace "$out/trace_pp512_$g.json" 2>&1 | quiet | tee "$out/gemm_pp512_$g.txt"
    done
    ;;
  parity)
    s8=$(dev_synth llama3-8b 8)
    for g in 4 off; do
      $bin/strata check -m "$s8" --device gpu --gemm $g -n 16 --with-cpu 2>&1 | quiet | tee "$out/gemm_parity_$g.txt"
    done
    ;;
  batch)
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 0 -B 64 --batch-steps 4 -r 2 \
      --llama-ngl 20 --llama-best 2>&1 | quiet | tee "$out/gemm_batch_12g.txt"
    ;;
  best99)
    timeout 300 $bin/strata "${b[@]}" -r 2 --llama-ngl 99 --llama-best 2>&1 | quiet | tee "$out/gemm_best99.txt"
    ;;
  decode24)
    timeout 240 $bin/strata bench -m "$m" --device gpu --gpu-budget 24G -p 0 -n 16 -B 0 -r 3 --llama-ngl 44 \
      2>&1 | quiet | tee "$out/gemm_decode_24g.txt"
    ;;
  *) echo "gemm.sh: unknown mode $what (probe, compare, compare12, headline, resident, pp512, pp512both, parity, batch, best99, decode24)" >&2; exit 2 ;;
esac
done
