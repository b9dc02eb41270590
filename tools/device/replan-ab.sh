#!/usr/bin/env bash
# The host groups planned again from the host's measured speed
# (`CpuCalibration::replan`) against the load's plan kept
# (STRATA_REPLAN=off), on the Qwen3-30B-A3B shape in the Q4_K_M mix at 8G
# (routing skew SKEW, default 1), 64 sequences: `strata bench -p 0 -n 0 -B
# 64 -r REPS` (default 3), ROUNDS rounds interleaved (default 3), one call:
#   export OUT=$OUT; bash tools/device/replan-ab.sh
# Outputs: $OUT/replan-ab.tar (ab_R_{on,off}.txt, the machine and clock).
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_machine >/dev/null
dev_clock
dev_module_start
s=$(SKEW=${SKEW:-1} TYPE=q4_k_m dev_synth qwen3-30b-a3b)
echo "model: $s" > "$out/model.txt"
dev_module_wait > "$out/module.txt" 2>&1
common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
for r in $(seq 1 "${ROUNDS:-3}"); do
  for m in on off; do
    dev_mark "round $r: replan $m"
    { echo "== round $r: STRATA_REPLAN=$m strata bench $common -p 0 -n 0 -B 64 -r ${REPS:-3}"
      STRATA_REPLAN=$m STRATA_LOG=strata=info timeout 150 $bin/strata bench $common -p 0 -n 0 -B 64 -r "${REPS:-3}" 2>&1 | quiet; } \
      > "$out/ab_${r}_$m.txt"
  done
done
tar -cf "$out/replan-ab.tar" -C "$out" $(cd "$out" && ls | grep -v '^replan-ab.tar$') && \
  (cd "$out" && ls | grep -v '^replan-ab.tar$' | xargs rm -f)
exit 0
