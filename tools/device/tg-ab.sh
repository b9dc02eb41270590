#!/usr/bin/env bash
# Decode (tg16) under flag sets, interleaved: the Qwen3-30B-A3B shape in
# the Q4_K_M mix at 8G, skewed routing (SKEW, default 1), no router counts,
# `strata bench -p 0 -n 16 -B 0 -r 3` under each set of SETS (separated by
# commas; each "ENV ...|FLAGS"; default: everything default, the inputs
# copied, no carried uploads), ROUNDS rounds (default 3), tg_R_N.txt.
#   export OUT=$OUT; bash tools/device/tg-ab.sh
# Outputs: $OUT/tg-ab.tar (everything above, the machine and clock).
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_machine >/dev/null
dev_clock
dev_module_start
s=$(SKEW=${SKEW:-1} TYPE=q4_k_m dev_synth qwen3-30b-a3b)
echo "model: $s" > "$out/model.txt"
dev_module_wait > "$out/module.txt" 2>&1
common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
IFS=, read -ra sets <<< "${SETS:-|,STRATA_INPUTS=copy|,|--no-carry}"
for r in $(seq 1 "${ROUNDS:-3}"); do
  i=0
  for set in "${sets[@]}"; do
    envs=${set%%|*}; flags=${set#*|}
    rm -f "$s.experts.json"
    dev_mark "round $r, set $i: $set"
    # shellcheck disable=SC2086 # envs and flags: split on spaces
    { echo "== round $r: $envs strata bench $common -p 0 -n 16 -B 0 -r 3 $flags"
      env STRATA_LOG=strata=info $envs timeout 120 $bin/strata bench $common -p 0 -n 16 -B 0 -r 3 $flags 2>&1 | quiet; } \
      > "$out/tg_${r}_$i.txt"
    i=$((i + 1))
  done
done
tar -cf "$out/tg-ab.tar" -C "$out" $(cd "$out" && ls | grep -v '^tg-ab.tar$') && \
  (cd "$out" && ls | grep -v '^tg-ab.tar$' | xargs rm -f)
exit 0
