#!/usr/bin/env bash
# On the two-GPU machine (nvidia-h200-x2 / nvidia-h100-x2): where the row
# split's steps lose time besides computing (issue 28). The 70B-shaped
# Q4_0 at 12G on each GPU, `-p 2048 -b 2048 -ub 2048 -n 16 -B 0 -r 3`
# (TESTS replaces it), in one call:
#   1. the cgroup's CPU quota and throttling counters, before and after;
#   2. ROUNDS rounds (default 2) of every binary (HEAD, then each older
#      one in .carry/old/*.xz, tools/device/build-old.sh) with every
#      VARIANT (flags, separated by |; default "default|--poll 0|-t 8"),
#      interleaved, each with the debug lines of every row-split step
#      (how long the host took to queue its groups, its longest turn,
#      where its time went), of its inputs and of its activation memory;
#   3. with ONE=1, each binary on one GPU at 12G (the ratio's baseline;
#      ONE=HEAD: HEAD's alone);
#   4. with TOP=1, the defaults once more with `top -H` sampling the
#      process's threads every second (those above 20% CPU), and a trace
#      with TRACE=1.
# Results in $OUT/gaps.txt (and trace_70b_2x12g_row_gaps.json.gz).
#   XZ_BIN=1 tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   TOP=1 TRACE=1 bash tools/device/row-gaps.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_70b || exit 1
tests=${TESTS:-"-p 2048 -b 2048 -ub 2048 -n 16 -B 0 -r 3"}
f=$out/gaps.txt
cg() { for x in /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu.stat /sys/fs/cgroup/cpuset.cpus.effective; do
  [ -f $x ] && echo "$x: $(paste -sd' ' $x)"; done; echo "nproc $(nproc)"; }
{ echo "== cgroup before"; cg; } | tee "$f"
o=/root/old; mkdir -p $o
names=(HEAD)
for x in .carry/old/*.xz; do
  [ -f "$x" ] || continue
  n=$(basename "$x" .xz); xz -dc "$x" > $o/strata-$n; chmod +x $o/strata-$n; names+=("$n")
done
cp $bin/lib*.so* $o/; rm -f $o/*.ggml-version
exe() { [ "$1" = HEAD ] && echo $bin/strata || echo $o/strata-$1; }
export STRATA_LOG=strata::engine::rows=debug,strata::engine::inputs=debug,strata::engine::templates=debug
keep() { quiet | grep -e "pp[0-9]" -e "tg[0-9]" -e batched -e rror -e "row step" -e "inputs written" -e "grew" |
  sed 's/^.*\(row step\|step of\|activations grew\)/\1/'; }
IFS='|' read -r -a variants <<< "${VARIANTS:-default|--poll 0|-t 8}"
for r in $(seq ${ROUNDS:-2}); do
  for n in "${names[@]}"; do
    for v in "${variants[@]}"; do
      echo "-- round $r: $n, $v" | tee -a "$f"
      timeout 200 $(exe $n) bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G --split-mode row $tests \
        $([ "$v" = default ] || echo "$v") 2>&1 | keep | tee -a "$f"
    done
  done
done
if [ -n "${ONE:-}" ]; then
  for n in "${names[@]}"; do
    [ "$ONE" = 1 ] || [ "$ONE" = "$n" ] || continue
    echo "-- $n, one GPU at 12G" | tee -a "$f"
    timeout 200 $(exe $n) bench -m "$m" --device gpu --devices 0 --gpu-budget 12G $tests 2>&1 | keep |
      grep -v "row step" | tee -a "$f"
  done
fi
if [ -n "${TOP:-}" ]; then
  echo "== the defaults, threads above 20% CPU each second (top -H)" | tee -a "$f"
  $bin/strata bench -m "$m" --device gpu --devices 0,1 --gpu-budget 12G --split-mode row $tests \
    ${TRACE:+--trace "$out/trace_70b_2x12g_row_gaps.json"} > "$out/top_bench.log" 2>&1 &
  pid=$!
  top -H -b -d 1 -n 90 -p $pid 2>/dev/null | awk '/^top -/{n++; print "sample " n} $9+0 >= 20 {print}' > "$out/top.txt" &
  wait $pid
  pkill -x top 2>/dev/null
  keep < "$out/top_bench.log" | tee -a "$f"
  rm -f "$out/top_bench.log"
  [ -f "$out/trace_70b_2x12g_row_gaps.json" ] && gzip -f "$out/trace_70b_2x12g_row_gaps.json"
fi
{ echo "== cgroup after"; cg; } | tee -a "$f"
for g in machine.txt module.txt synth.txt; do
  [ -f "$out/$g" ] && { echo "== $g"; cat "$out/$g"; rm -f "$out/$g"; } >> "$f"
done
