#!/usr/bin/env bash
# Decode (tg16) under flag sets, interleaved: the Qwen3-30B-A3B shape in
# the Q4_K_M mix at 8G, skewed routing (SKEW, default 1), no router counts,
# `strata bench -p 0 -n 16 -B 0 -r 3` under each set of SETS (separated by
# commas; each "ENV ...|FLAGS"; default: everything default, the inputs
# copied, no carried uploads), ROUNDS rounds (default 3), tg_R_N.txt.
#   export OUT=$OUT; bash tools/device/tg-ab.sh
# Outputs: $OUT/tg-ab.tar (everything above, the machine and clock).
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_moe30b
IFS=, read -ra sets <<< "${SETS:-|,STRATA_INPUTS=copy|,|--no-carry}"
dev_before() { rm -f "$s.experts.json"; }
dev_rounds tg "${ROUNDS:-3}" "-p 0 -n 16 -B 0 -r 3"
tar -cf "$out/tg-ab.tar" -C "$out" $(cd "$out" && ls | grep -v '^tg-ab.tar$') && \
  (cd "$out" && ls | grep -v '^tg-ab.tar$' | xargs rm -f)
exit 0
