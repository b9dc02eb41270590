#!/usr/bin/env bash
# On the GPU machine: hybrid decode (the host CPU computes streamed FFN
# groups while the bus streams the rest) on the 70B-shaped Q4_0 model, side
# by side with strata without it and llama.cpp with its default settings at
# the same GPU memory; big steps (pp2048, 64 sequences) with hybrid on; a
# trace of the hybrid step; NMSE against llama.cpp all on the GPU; and
# compute-sanitizer on a forced hybrid run of a tiny model. (Speculative
# decoding with hybrid decode: tools/device/spec.sh hybrid, hybrid24.)
#   tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/hybrid.sh bench    # 12G and 24G decode (hybrid, not, llama.cpp), traces
#   bash tools/device/hybrid.sh sweep    # 12G: CPU groups auto / 61 / 30 (SPLITS=...; TRACE=1 traces), T15=1: -t 15
#   bash tools/device/hybrid.sh big      # pp2048 and 64-sequence decode at 12G
#   bash tools/device/hybrid.sh ub       # 12G decode: default plan (-ub 512) vs decode-sized (-ub 16) vs -ub 2048
#   bash tools/device/hybrid.sh ffn      # 12G pp2048: the plan's FFN chunks vs whole steps, interleaved
#   bash tools/device/hybrid.sh checks   # NMSE vs llama.cpp all-GPU, compute-sanitizer
#   bash tools/device/hybrid.sh bound    # the CUDA-vs-CPU NMSE bound; 12G without hybrid
# Several may be named in one call (bash tools/device/hybrid.sh bench sweep).
# REPS (default 3) repetitions per bench. Results under $OUT; a CUDA module
# built here comes back in $OUT/cuda/ (bench).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_70b || exit 1
R=${REPS:-3}
for what in ${@:-bench}; do
case "$what" in
bench)
  {
    echo "== 12G: strata hybrid auto (plan, prediction), hybrid off, llama.cpp ngl=24 with its defaults"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 16 -B 0 -r $R --llama-ngl 24 \
      --trace "$out/trace_hybrid_12g.json" 2>&1 | quiet
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --hybrid off -p 0 -n 16 -B 0 -r $R 2>&1 | quiet
    echo "== 24G: strata hybrid auto, llama.cpp ngl=44 with its defaults"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 24G -p 0 -n 16 -B 0 -r $R --llama-ngl 44 \
      --trace "$out/trace_hybrid_24g.json" 2>&1 | quiet
  } 2>&1 | tee "$out/hybrid_bench.txt"
  # a module built here, for the next carry (.carry-cache/)
  dev_keep_module ;;
sweep)
  {
    echo "== 12G: how many FFN groups the CPU should take (auto: the plan's choice)"
    for h in ${SPLITS:-auto 61 30}; do
      STRATA_LOG=strata=info $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --hybrid $h -p 0 -n 16 -B 0 -r 1 \
        ${TRACE:+--trace "$out/trace_hybrid_12g_$h.json"} 2>&1 | quiet | grep -v "^plan:\|^strata:"
    done
    [ -z "${T15:-}" ] || $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -t 15 -p 0 -n 16 -B 0 -r 1 2>&1 | quiet | grep "tg16\|host CPU"
  } 2>&1 | tee "$out/hybrid_sweep.txt" ;;
big)
  {
    echo "== 12G, hybrid auto: pp2048 and 64-sequence decode (the CPU takes no part above 32 tokens)"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 2048 -b 2048 -ub 2048 -n 0 -B 64 -r 2 2>&1 | quiet
  } 2>&1 | tee "$out/hybrid_big.txt" ;;
ub)
  {
    echo "== 12G decode: the default plan (-ub 512) against a decode-sized (-ub 16) and a prefill-sized (-ub 2048) one, interleaved"
    for rep in 1 2; do
      for ub in 512 16 2048; do
        echo "-- round $rep: -ub $ub"
        $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -b 2048 -ub $ub -p 0 -n 16 -B 0 -r $R 2>&1 | quiet \
          | grep -e "^plan:" -e "^memory:" -e "tg16" -e "measured/predicted"
      done
    done
  } 2>&1 | tee "$out/hybrid_ub.txt" ;;
ffn)
  {
    echo "== 12G pp2048: FFN in the plan's chunks against whole steps (--ffn-rows 2048), interleaved"
    for rep in 1 2; do
      for rows in plan 2048; do
        echo "-- round $rep: FFN rows $rows"
        $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 2048 -b 2048 -ub 2048 -n 0 -B 0 -r 2 \
          $([ $rows = plan ] || echo --ffn-rows $rows) 2>&1 | quiet | grep -e "^plan:" -e "^memory:" -e "pp2048"
      done
    done
  } 2>&1 | tee "$out/hybrid_ffn.txt" ;;
bound)
  {
    echo "== the CUDA-vs-CPU bound: strata all resident on the GPU vs llama.cpp (GPU) and vs strata on the CPU"
    $bin/strata check -m "$m" --device gpu --with-cpu -n 8 -c 512 2>&1 | quiet
    echo "== strata 12G without hybrid vs llama.cpp all on the GPU"
    $bin/strata check -m "$m" --device gpu --gpu-budget 12G --hybrid off -n 8 -c 512 2>&1 | quiet
  } 2>&1 | tee "$out/hybrid_bound.txt" ;;
checks)
  {
    echo "== NMSE: strata 12G hybrid vs llama.cpp all on the GPU"
    $bin/strata check -m "$m" --device gpu --gpu-budget 12G -n 8 -c 512 2>&1 | quiet
  } 2>&1 | tee "$out/hybrid_check.txt"
  t=$(dev_synth tiny)
  cs=$(dev_sanitizer)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool, forced hybrid (every other FFN group on the CPU)"
    timeout 200 "$cs" --tool $tool $bin/strata run -m $t --device gpu --stream-all --hybrid 2 --slots 2 \
      -c 256 -b 32 -p "Hello there" -n 4 --temp 0 2>&1 | quiet | tail -4
  done 2>&1 | tee "$out/hybrid_sanitizer.txt" ;;
*) echo "hybrid.sh: unknown mode $what (bench sweep big ub ffn bound checks)" >&2; exit 2 ;;
esac
done
ls -la "$out"
