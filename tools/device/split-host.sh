#!/usr/bin/env bash
# The expert split against whole host groups (issue 31): the Qwen3-30B-A3B
# shape in the Q4_K_M mix at 8G with skewed routing (SKEW, default 1), 64
# sequences, after a counting pass (`--expert-stats`, so the split's GPU
# side takes each layer's most picked experts), in one call:
# 1. check: greedy text of a prompt of about 50 tokens (one step the plan
#    splits) with each flag set of SPLITS after the first must equal the
#    first's (`strata run --temp 0`): the split computes what whole groups
#    do, up to the two sides' rounding (a split layer sums the GPU's and the
#    host's experts apart); and each split set again with
#    STRATA_SPLIT_READS=drain must give its text exactly (check.txt);
#    Each run starts from the counts the counting pass left. CHECK=0 skips
#    this stage.
# 2. rounds: `strata bench -p 0 -n 0 -B 64 -r REPS` under each flag set of
#    SPLITS (separated by commas; default whole host groups, then
#    `--expert-split 64` and `--expert-split 80`), ROUNDS rounds interleaved
#    (default 1), split_R_N.txt;
# 3. with TRACE=1, one more traced load of each set (trace_split_N.json.xz):
#    the trace's host track carries each split layer's router round trip
#    ("router N: rows and picks read") and its host part's phases (rows in,
#    experts, rows out).
#   export OUT=$OUT; bash tools/device/split-host.sh
# Outputs: $OUT/split-host.tar (everything above, the machine and clock).
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_moe30b_counted
IFS=, read -ra sets <<< "${SPLITS:-,--expert-split 64,--expert-split 80}"
prompt="In the quiet town by the river, the old clockmaker kept a workshop full of ticking machines, \
each one built for a different purpose, and every morning he wound them all before the baker opened"
# every run with a split adds its picks to the counts beside the model, which
# order the split's GPU experts: each run starts from the same counts
cp "$s.experts.json" "$out/counts.json"
[ "${CHECK:-1}" = 1 ] && {
  i=0
  for f in "${sets[@]}"; do
    cp "$out/counts.json" "$s.experts.json"
    echo "== strata run -m $s --device gpu --gpu-budget 8G -c 4096 -ub 64 --temp 0 -n 24 -p PROMPT $f"
    timeout 100 $bin/strata run -m "$s" --device gpu --gpu-budget 8G -c 4096 -ub 64 --temp 0 -n 24 -v -p "$prompt" $f \
      2> "$out/run_$i.log" > "$out/text_$i.txt"
    cat "$out/text_$i.txt"; echo
    if [ $i -gt 0 ]; then
      cmp -s "$out/text_0.txt" "$out/text_$i.txt" && echo "same text as the first" || echo "TEXT DIFFERS from the first"
    fi
    i=$((i + 1))
  done
  # the split's router reads queued behind the router (a GPU's default)
  # against the device drained first: the same tokens
  for j in $(seq 1 $((${#sets[@]} - 1))); do
    f=${sets[$j]}
    cp "$out/counts.json" "$s.experts.json"
    echo "== STRATA_SPLIT_READS=drain strata run ... $f"
    STRATA_SPLIT_READS=drain timeout 100 $bin/strata run -m "$s" --device gpu --gpu-budget 8G -c 4096 -ub 64 --temp 0 -v \
      -n 24 -p "$prompt" $f 2> "$out/run_drain_$j.log" > "$out/text_drain_$j.txt"
    cat "$out/text_drain_$j.txt"; echo
    cmp -s "$out/text_$j.txt" "$out/text_drain_$j.txt" && echo "same text as the queued reads" \
      || echo "TEXT DIFFERS from the queued reads"
    # and the queued reads once more: a run repeats itself
    cp "$out/counts.json" "$s.experts.json"
    timeout 100 $bin/strata run -m "$s" --device gpu --gpu-budget 8G -c 4096 -ub 64 --temp 0 -n 24 -p "$prompt" $f \
      2> /dev/null > "$out/text_again_$j.txt"
    cmp -s "$out/text_$j.txt" "$out/text_again_$j.txt" && echo "queued reads again: the same text" \
      || echo "queued reads again: TEXT DIFFERS"
  done
} > "$out/check.txt" 2>&1
for r in $(seq 1 "${ROUNDS:-1}"); do
  i=0
  for f in "${sets[@]}"; do
    dev_mark "round $r, split set $i: $f"
    { echo "== round $r: strata bench $common -p 0 -n 0 -B 64 -r ${REPS:-2} $f"
      STRATA_LOG=strata=info timeout 150 $bin/strata bench $common -p 0 -n 0 -B 64 -r "${REPS:-2}" $f 2>&1 | quiet; } \
      > "$out/split_${r}_$i.txt"
    i=$((i + 1))
  done
done
if [ "${TRACE:-0}" = 1 ]; then
  i=0
  for f in "${sets[@]}"; do
    { echo "== strata bench $common -p 0 -n 0 -B 64 -r 2 $f --trace"
      STRATA_LOG=strata=info timeout 150 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 $f \
        --trace "$out/trace_split_$i.json" 2>&1 | quiet; } > "$out/trace_split_$i.txt"
    xz -9 "$out/trace_split_$i.json" 2>/dev/null
    i=$((i + 1))
  done
fi
# one file back: the device tool returns a handful of files a call
tar -cf "$out/split-host.tar" -C "$out" $(cd "$out" && ls | grep -v '^split-host.tar$') && \
  (cd "$out" && ls | grep -v '^split-host.tar$' | xargs rm -f)
exit 0
