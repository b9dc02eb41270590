#!/usr/bin/env bash
# Issue 31's skewed 64-sequence test with a split flag set beside
# llama.cpp (the Qwen3-30B-A3B shape in the Q4_K_M mix at 8G, skewed
# routing), one call:
# 1. a counting pass (`--expert-stats`), which orders the split's GPU
#    experts;
# 2. table: `strata bench -p 0 -n 0 -B 64 -r 2 FLAGS` with llama.cpp
#    `-ngl 99 --n-cpu-moe NCM` (default 30) beside, its defaults and
#    `--no-mmap -ub 2048` (table.txt);
# 3. strata alone, interleaved ROUNDS times (default 1): the default
#    placement (whole host groups) and FLAGS again (alone_R_*.txt).
# FLAGS defaults to "--expert-split 104 --split-whole 11". Each strata
# load starts from the counting pass's counts.
#   export OUT=$OUT; bash tools/device/split-table.sh
# Outputs: $OUT/split-table.tar.
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_moe30b_counted
flags=${FLAGS:---expert-split 104 --split-whole 11}
cp "$s.experts.json" "$out/counts.json"
dev_mark table
# shellcheck disable=SC2086 # flags: split on spaces
{ echo "== strata bench $common -p 0 -n 0 -B 64 -r 2 $flags --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-30}"
  STRATA_LOG=strata=info timeout 330 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 $flags \
    --llama-ngl 99 --llama-best --llama-n-cpu-moe "${NCM:-30}" 2>&1 | quiet; } > "$out/table.txt"
for r in $(seq 1 "${ROUNDS:-1}"); do
  i=0
  for f in "" "$flags"; do
    cp "$out/counts.json" "$s.experts.json"
    dev_mark "alone round $r: $f"
    # shellcheck disable=SC2086
    { echo "== round $r: strata bench $common -p 0 -n 0 -B 64 -r 2 $f"
      STRATA_LOG=strata=info timeout 150 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 $f 2>&1 | quiet; } \
      > "$out/alone_${r}_$i.txt"
    i=$((i + 1))
  done
done
tar -cf "$out/split-table.tar" -C "$out" $(cd "$out" && ls | grep -v '^split-table.tar$') && \
  (cd "$out" && ls | grep -v '^split-table.tar$' | xargs rm -f)
exit 0
