#!/usr/bin/env bash
# On the GPU machine: hybrid decode (the host CPU computes streamed FFN
# groups while the bus streams the rest) on the 70B-shaped Q4_0 model, side
# by side with strata without it and llama.cpp with its default settings at
# the same GPU memory; big steps (pp2048, 64 sequences) with hybrid on; a
# trace of the hybrid step; NMSE against llama.cpp all on the GPU; and
# compute-sanitizer on a forced hybrid run of a tiny model.
#   tools/pack-device.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device-hybrid.sh bench    # 12G and 24G decode (hybrid, not, llama.cpp), trace
#   bash tools/device-hybrid.sh sweep    # 12G: CPU groups auto / 61 / 30 (SPLITS=...), T15=1: -t 15
#   bash tools/device-hybrid.sh big      # pp2048 and 64-sequence decode at 12G
#   bash tools/device-hybrid.sh ub       # 12G decode: default plan (-ub 512) vs decode-sized (-ub 16) vs -ub 2048
#   bash tools/device-hybrid.sh ffn      # 12G pp2048: the plan's FFN chunks vs whole steps, interleaved
#   bash tools/device-hybrid.sh checks   # NMSE vs llama.cpp all-GPU, compute-sanitizer
#   bash tools/device-hybrid.sh bound    # the CUDA-vs-CPU NMSE bound; 12G without hybrid
# Several may be named in one call (bash tools/device-hybrid.sh bench sweep).
# The module and models go under /root (kept while the machine stays warm).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device-70b.sh
R=${REPS:-3}
for what in ${@:-bench}; do
case "$what" in
bench)
  {
    echo "== 12G: strata hybrid auto (plan, prediction), hybrid off, llama.cpp ngl=24 with its defaults"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 16 -B 0 -r $R --llama-ngl 24 \
      --trace "$out/trace_hybrid_12g.json" 2>&1 | f
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --hybrid off -p 0 -n 16 -B 0 -r $R 2>&1 | f
    echo "== 24G: strata hybrid auto, llama.cpp ngl=44 with its defaults"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 24G -p 0 -n 16 -B 0 -r $R --llama-ngl 44 \
      --trace "$out/trace_hybrid_24g.json" 2>&1 | f
  } 2>&1 | tee "$out/hybrid_bench.txt"
  # keep a module built here for a fresh machine (16 MB per returned file)
  grep -q restored "$out/module.txt" 2>/dev/null || { xz -T0 -3 -c /root/cuda/libggml-cuda.so \
    | split -b 15m - "$out/libggml-cuda.so.xz.part-" && cp /root/cuda/libggml-cuda.so.ggml-version "$out/"; } ;;
sweep)
  {
    echo "== 12G: how many FFN groups the CPU should take (auto: the plan's choice)"
    for h in ${SPLITS:-auto 61 30}; do
      STRATA_LOG=strata=info $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --hybrid $h -p 0 -n 16 -B 0 -r 1 \
        ${TRACE:+--trace "$out/trace_hybrid_12g_$h.json"} 2>&1 | f | grep -v "^plan:\|^strata:"
    done
    [ -z "${T15:-}" ] || $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -t 15 -p 0 -n 16 -B 0 -r 1 2>&1 | f | grep "tg16\|host CPU"
  } 2>&1 | tee "$out/hybrid_sweep.txt" ;;
big)
  {
    echo "== 12G, hybrid auto: pp2048 and 64-sequence decode (the CPU takes no part above 32 tokens)"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 2048 -b 2048 -ub 2048 -n 0 -B 64 -r 2 2>&1 | f
  } 2>&1 | tee "$out/hybrid_big.txt" ;;
ub)
  {
    echo "== 12G decode: the default plan (-ub 512) against a decode-sized (-ub 16) and a prefill-sized (-ub 2048) one, interleaved"
    for rep in 1 2; do
      for ub in 512 16 2048; do
        echo "-- round $rep: -ub $ub"
        $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -b 2048 -ub $ub -p 0 -n 16 -B 0 -r $R 2>&1 | f \
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
          $([ $rows = plan ] || echo --ffn-rows $rows) 2>&1 | f | grep -e "^plan:" -e "^memory:" -e "pp2048"
      done
    done
  } 2>&1 | tee "$out/hybrid_ffn.txt" ;;
bound)
  {
    echo "== the CUDA-vs-CPU bound: strata all resident on the GPU vs llama.cpp (GPU) and vs strata on the CPU"
    $bin/strata check -m "$m" --device gpu --with-cpu -n 8 -c 512 2>&1 | f
    echo "== strata 12G without hybrid vs llama.cpp all on the GPU"
    $bin/strata check -m "$m" --device gpu --gpu-budget 12G --hybrid off -n 8 -c 512 2>&1 | f
  } 2>&1 | tee "$out/hybrid_bound.txt" ;;
spec|spec24)
  # a Llama-3.2-1B-shaped draft with the target's vocabulary, resident
  d=/root/m/llama3.2-1b-q4_0.gguf
  [ -f "$d" ] || $bin/strata-convert synth --preset llama3.2-1b --type q4_0 --vocab-from $v "$d" 2>&1 | tail -1 >> "$out/synth.txt"
  if [ "$what" = spec ]; then b=12G; ngl=24; else b=24G; ngl=44; fi
  {
    echo "== $b, hybrid auto, draft resident: the target step with 1+k tokens, the draft's time for k tokens"
    $bin/strata bench -m "$m" --device gpu --gpu-budget $b -md "$d" -p 0 -n 16 -B 0 -r $R --spec-k 0,1,2,4,8,16 \
      --trace "$out/trace_spec_hybrid_${b}_k16.json" 2>&1 | f
    echo "== $b, hybrid off, draft resident"
    $bin/strata bench -m "$m" --device gpu --gpu-budget $b --hybrid off -md "$d" -p 0 -n 0 -B 0 -r $R --spec-k 0,4,8,16 2>&1 | f
    echo "== llama.cpp ngl=$ngl with its default settings, same file"
    $bin/strata bench -m "$m" --device gpu --no-strata -p 0 -n 16 -B 0 -r $R --llama-ngl $ngl 2>&1 | f
  } 2>&1 | tee "$out/spec_hybrid_$b.txt" ;;
checks)
  {
    echo "== NMSE: strata 12G hybrid vs llama.cpp all on the GPU"
    $bin/strata check -m "$m" --device gpu --gpu-budget 12G -n 8 -c 512 2>&1 | f
  } 2>&1 | tee "$out/hybrid_check.txt"
  t=/root/m/tiny.gguf
  [ -f $t ] || $bin/strata-convert synth --preset tiny --type q4_0 --vocab-from $v $t > /dev/null 2>&1
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool, forced hybrid (every other FFN group on the CPU)"
    timeout 200 "$cs" --tool $tool $bin/strata run -m $t --device gpu --stream-all --hybrid 2 --slots 2 \
      -c 256 -b 32 -p "Hello there" -n 4 --temp 0 2>&1 | f | tail -4
  done 2>&1 | tee "$out/hybrid_sanitizer.txt" ;;
esac
done
ls -la "$out"
