#!/usr/bin/env bash
# A step's inputs pulled up by the compute stream (the default on a GPU,
# `engine::inputsup`) against copied (`STRATA_INPUTS=copy`), on issue 31's
# skewed 64-sequence test (the Qwen3-30B-A3B shape in the Q4_K_M mix at
# 8G, skewed routing), after a counting pass, in one call:
# 1. check: greedy text of a prompt of about 50 tokens with the inputs
#    pulled and copied must be the same (`strata run --temp 0`), carried
#    uploads on (check.txt);
# 2. rounds: `strata bench -p 0 -n 0 -B 64 -r 2` under each set of SETS
#    (separated by commas; each "ENV ...|FLAGS"), ROUNDS rounds interleaved
#    (default 2), ab_R_N.txt; the default sets: everything default; the
#    inputs copied; copied, no carried uploads and 12 host groups (the
#    default step before the inputs were pulled); pulled with 12 host
#    groups;
# 3. with TRACE=1, one more traced load of the first set (trace.json.xz).
# CHECK=0 skips the check (sets whose outputs are the same by design).
# With AB=STRATA_HOPS the check compares the residual's hops by kernels
# (`engine::hops`, the default) against copies (`STRATA_HOPS=copy`), and
# the default sets are: everything default; the hops copied.
#   export OUT=$OUT; bash tools/device/inputs-ab.sh
# Outputs: $OUT/inputs-ab.tar (everything above, the machine and clock).
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_moe30b_counted
ab=${AB:-STRATA_INPUTS}
if [ "$ab" = STRATA_HOPS ]; then
  default_sets="|,STRATA_HOPS=copy|"
else
  default_sets="|,STRATA_INPUTS=copy|,STRATA_INPUTS=copy|--no-carry --hybrid 12,|--hybrid 12"
fi
IFS=, read -ra sets <<< "${SETS:-$default_sets}"
cp "$s.experts.json" "$out/counts.json"
prompt="In the quiet town by the river, the old clockmaker kept a workshop full of ticking machines, \
each one built for a different purpose, and every morning he wound them all before the baker opened"
[ "${CHECK:-1}" = 0 ] || {
  for v in kernels copy; do
    cp "$out/counts.json" "$s.experts.json"
    echo "== $ab=$v strata run -m $s --device gpu --gpu-budget 8G -c 4096 -ub 64 --temp 0 -n 24 -p PROMPT"
    env "$ab=$v" timeout 100 $bin/strata run -m "$s" --device gpu --gpu-budget 8G -c 4096 -ub 64 --temp 0 -n 24 \
      -p "$prompt" 2> "$out/run_$v.log" > "$out/text_$v.txt"
    cat "$out/text_$v.txt"; echo
  done
  cmp -s "$out/text_kernels.txt" "$out/text_copy.txt" && echo "same text with $ab by kernels and copied" \
    || echo "TEXT DIFFERS between $ab by kernels and copied"
} > "$out/check.txt" 2>&1
dev_before() { cp "$out/counts.json" "$s.experts.json"; }
dev_rounds ab "${ROUNDS:-2}" "-p 0 -n 0 -B 64 -r 2"
if [ "${TRACE:-0}" = 1 ]; then
  set=${sets[0]}; envs=${set%%|*}; flags=${set#*|}
  cp "$out/counts.json" "$s.experts.json"
  # shellcheck disable=SC2086
  { echo "== $envs strata bench $common -p 0 -n 0 -B 64 -r 2 $flags --trace"
    env STRATA_LOG=strata=info $envs timeout 150 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 $flags \
      --trace "$out/trace.json" 2>&1 | quiet; } > "$out/trace.txt"
  xz -9 "$out/trace.json" 2>/dev/null
fi
# one file back: the device tool returns a handful of files a call
tar -cf "$out/inputs-ab.tar" -C "$out" $(cd "$out" && ls | grep -v '^inputs-ab.tar$') && \
  (cd "$out" && ls | grep -v '^inputs-ab.tar$' | xargs rm -f)
exit 0
