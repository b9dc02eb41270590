#!/usr/bin/env bash
# On the two-GPU machine (nvidia-h100-x2 / nvidia-h200-x2): a model's layers
# split across both GPUs, each streaming its own range over its own link
# (issue 28). Modes, several per call (default: smoke strata):
#   smoke   the Llama-3-8B-shaped Q4_0 model: `strata devices`; CUDA parity
#           of the split against llama.cpp on the GPUs, all resident
#           (--gpu-budget 3G) and streaming most of each part (1200M; with
#           RELAY=--relay the relay carries every other FFN group),
#           CHECK_BUDGETS to choose; pp512 and tg16 split (relay off and on)
#           and on one GPU
#   strata  the 70B-shaped Q4_0 model: 12G on each of two GPUs (trace of
#           the decode steps) and with --relay, 24G on one GPU, 12G on one
#           GPU: pp2048, tg16 and 64 sequences
#   relay   the 70B at 12G on each of two GPUs with and without --relay
#           (tg16, 64 sequences; traces)
#   rows    the row split (--split-mode row: every GPU a share of every
#           layer's heads and FFN columns) beside the layer split: CUDA
#           parity of the row split on 8 layers of the 8B shape against
#           llama.cpp, then the 70B at 12G on each of two GPUs, both
#           splits (pp2048, tg16, 64 sequences; the row split's trace with
#           TRACE=1; SPLITS=row for the row split alone; NOCHECK=1 skips
#           the parity check); the CUDA module
#           kept for .carry-cache where it was built here; the machine's
#           logs folded into rows.txt (a call returns 8 files)
#   one     the 70B on one GPU at 24G and at 12G (the same tests)
#   rows-old the row split at 12G on each GPU: HEAD and each older binary
#           in .carry/old/*.xz (tools/device/build-old.sh), interleaved over
#           ROUNDS rounds (default 2); with STRATA_LOG set, the step lines
#           naming the inputs are kept (rows_old.txt)
#   llama   llama.cpp on the same file over both GPUs (its default layer
#           split, about -ts 1,1 on two idle GPUs) at each of LLAMA_NGL
#           (default 40), with its defaults and with --no-mmap -ub 2048
#           (--llama-best), the same tests
# TESTS replaces the bench tests (default -p 2048 -b 2048 -ub 2048 -n 16
# -B 64 --batch-steps 2 -r 2; the trace is of the generation test, else of
# the first).
#   tools/device/pack.sh VOCAB.gguf        (here), then on the device:
#   bash tools/device/multi-gpu.sh smoke strata llama
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
nvidia-smi --query-gpu=index,name,memory.total,memory.free,pcie.link.gen.current,pcie.link.width.current \
  --format=csv > "$out/gpus.txt" 2>&1
nvidia-smi topo -m >> "$out/gpus.txt" 2>&1
cat "$out/gpus.txt"
tests=${TESTS:-"-p 2048 -b 2048 -ub 2048 -n 16 -B 64 --batch-steps 2 -r 2"}
for what in ${@:-smoke strata}; do
case $what in
  smoke)
    dev_module_start
    s8=$(dev_synth llama3-8b)
    dev_module_wait || exit 1
    dev_keep_module
    f=$out/smoke.txt
    echo "== strata devices" | tee "$f"
    $bin/strata devices 2>&1 | quiet | tee -a "$f"
    for b in ${CHECK_BUDGETS:-3G 1200M}; do
      echo "== strata check --devices 0,1 --gpu-budget $b --hybrid off" | tee -a "$f"
      timeout 200 $bin/strata check -m "$s8" --device gpu --devices 0,1 --gpu-budget $b ${RELAY:-} --hybrid off -n 16 \
        2>&1 | quiet | tee -a "$f"
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "smoke: the split's parity check failed" | tee -a "$f"; exit 1; }
    done
    for d in "0,1 --gpu-budget 1200M" "0,1 --gpu-budget 1200M --relay" "0 --gpu-budget 2400M"; do
      echo "== strata bench --devices $d" | tee -a "$f"
      timeout 120 $bin/strata bench -m "$s8" --device gpu --devices $d -p 512 -n 16 -B 0 -r 2 \
        2>&1 | quiet | tee -a "$f"
    done
    ;;
  strata)
    dev_70b || exit 1
    dev_keep_module
    f=$out/bench_70b_2gpu.txt
    echo "== 12G on each of two GPUs" | tee "$f"
    timeout 240 $bin/strata bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G $tests \
      --trace "$out/trace_70b_2x12g.json" 2>&1 | quiet | tee -a "$f"
    echo "== 12G on each of two GPUs --relay" | tee -a "$f"
    timeout 240 $bin/strata bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G --relay $tests \
      2>&1 | quiet | tee -a "$f"
    echo "== 24G on one GPU" | tee -a "$f"
    timeout 180 $bin/strata bench -m "$m" --device gpu --devices 0 --gpu-budget 24G $tests \
      2>&1 | quiet | tee -a "$f"
    echo "== 12G on one GPU" | tee -a "$f"
    timeout 180 $bin/strata bench -m "$m" --device gpu --devices 0 --gpu-budget 12G $tests \
      2>&1 | quiet | tee -a "$f"
    ;;
  relay)
    dev_70b || exit 1
    dev_keep_module
    f=$out/bench_70b_relay.txt
    for r in "" "--relay"; do
      echo "== 12G on each of two GPUs ${r:-(no relay)}" | tee -a "$f"
      timeout 200 $bin/strata bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G $r -p 0 -n 16 -B 64 \
        --batch-steps 2 -r 2 --trace "$out/trace_70b_2x12g${r:+_relay}.json" 2>&1 | quiet | tee -a "$f"
    done
    ;;
  rows)
    dev_machine
    dev_module_start
    [ -n "${NOCHECK:-}" ] || s8=$(dev_synth llama3-8b 8)
    m=$(dev_synth llama3-70b)
    dev_module_wait || exit 1
    dev_keep_module
    f=$out/rows.txt
    cat "$out/gpus.txt" > "$f"
    if [ -z "${NOCHECK:-}" ]; then
      echo "== strata check --split-mode row --devices 0,1 --gpu-budget ${CHECK_BUDGET:-700M} (8 layers of the 8B shape)" | tee -a "$f"
      timeout 150 $bin/strata check -m "$s8" --device gpu --devices 0,1 --split-mode row --gpu-budget ${CHECK_BUDGET:-700M} \
        --hybrid off -n 16 2>&1 | quiet | tee -a "$f"
    fi
    for sm in ${SPLITS:-row layer}; do
      echo "== 12G on each of two GPUs --split-mode $sm" | tee -a "$f"
      timeout 200 $bin/strata bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G --split-mode $sm $tests \
        ${TRACE:+--trace "$out/trace_70b_2x12g_$sm.json"} 2>&1 | quiet | tee -a "$f"
      [ -f "$out/trace_70b_2x12g_$sm.json" ] && gzip -f "$out/trace_70b_2x12g_$sm.json"
    done
    for g in machine.txt module.txt synth.txt gpus.txt; do
      [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
    done
    ;;
  one)
    dev_70b || exit 1
    f=$out/one.txt
    for b in 24G 12G; do
      echo "== $b on one GPU" | tee -a "$f"
      timeout 180 $bin/strata bench -m "$m" --device gpu --devices 0 --gpu-budget $b $tests \
        2>&1 | quiet | tee -a "$f"
    done
    ;;
  rows-old)
    dev_70b || exit 1
    o=/root/old; mkdir -p $o
    cp $bin/lib*.so* $o/; rm -f $o/*.ggml-version
    names=(HEAD)
    for x in .carry/old/*.xz; do
      [ -f "$x" ] || continue
      n=$(basename "$x" .xz); xz -dc "$x" > $o/strata-$n; chmod +x $o/strata-$n; names+=("$n")
    done
    f=$out/rows_old.txt
    for r in $(seq ${ROUNDS:-2}); do
      for n in "${names[@]}"; do
        s=$o/strata-$n; [ "$n" = HEAD ] && s=$bin/strata
        echo "-- round $r: $n" | tee -a "$f"
        timeout 200 $s bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G --split-mode row $tests 2>&1 | quiet |
          grep -e "pp[0-9]" -e "tg[0-9]" -e batched -e rror -e "inputs written" | sed 's/^.*step: //' | tee -a "$f"
      done
    done
    ;;
  llama)
    dev_70b || exit 1
    f=$out/bench_70b_2gpu_llama.txt
    for n in ${LLAMA_NGL:-40}; do
      echo "== llama.cpp -ngl $n over both GPUs, defaults and --no-mmap -ub 2048" | tee -a "$f"
      timeout 400 $bin/strata bench -m "$m" --device gpu --no-strata $tests --llama-ngl $n --llama-best \
        2>&1 | quiet | tee -a "$f"
    done
    ;;
  *) echo "multi-gpu.sh: unknown mode $what (smoke, strata, rows, rows-old, one, relay, llama)" >&2; exit 2 ;;
esac
done
