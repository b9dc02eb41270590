#!/usr/bin/env bash
# Issue 31's table on the Qwen3-30B-A3B shape in the Q4_K_M mix at 8G, as
# a new user runs it (no router counts), routing skewed (SKEW, default 1;
# SKEW=0 uniform), llama.cpp from the same source on the same file beside,
# in one call:
# 1. parity: `strata check --hybrid off` (every streamed group on the bus,
#    carried uploads, the inputs pulled up by the compute stream) against
#    llama.cpp all on the GPU (check.txt);
# 2. table: `strata bench -p 2048 -n 16 -B 64 -r 2` with llama.cpp `-ngl 99
#    --n-cpu-moe 30,31`, its defaults and `--no-mmap -ub 2048`
#    (table.txt);
# 3. the 64-sequence test again beside `--n-cpu-moe 30`, AGAIN times
#    (default 1; b64_N.txt);
# 4. summary.txt: every load's 64-sequence ratio against llama.cpp's best
#    at no more GPU memory, sorted, and their median (a load where only
#    llama.cpp's defaults fit under strata's memory counts against those).
# Every engine runs each test once untimed first (bench's default);
# NO_WARMUP=1 passes --no-warmup to every bench.
#   export OUT=$OUT; bash tools/device/table31.sh
# Outputs: $OUT/table31.tar (everything above, the machine and clock).
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_moe30b
[ "${NO_WARMUP:-0}" = 1 ] && common="$common --no-warmup"
dev_mark check
{ echo "== strata check -m $s --device gpu --gpu-budget 8G -n 16 --hybrid off"
  timeout 200 $bin/strata check -m "$s" --device gpu --gpu-budget 8G -n 16 --hybrid off 2>&1 | quiet; } \
  > "$out/check.txt"
rm -f "$s.experts.json"
dev_mark table
{ echo "== strata bench $common -p 2048 -n 16 -B 64 -r 2 --llama-ngl 99 --llama-best --llama-n-cpu-moe 30,31"
  STRATA_LOG=strata=info timeout 330 $bin/strata bench $common -p 2048 -n 16 -B 64 -r 2 \
    --llama-ngl 99 --llama-best --llama-n-cpu-moe 30,31 2>&1 | quiet; } > "$out/table.txt"
for r in $(seq 1 "${AGAIN:-1}"); do
  rm -f "$s.experts.json"
  dev_mark "b64 $r"
  { echo "== strata bench $common -p 0 -n 0 -B 64 -r 2 --llama-ngl 99 --llama-best --llama-n-cpu-moe 30"
    STRATA_LOG=strata=info timeout 200 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 \
      --llama-ngl 99 --llama-best --llama-n-cpu-moe 30 2>&1 | quiet; } > "$out/b64_$r.txt"
done
# the 64-sequence ratio of every load of this call against llama.cpp's
# best at no more memory, and their median (summary.txt)
grep -h "^best  batched64x8" "$out/table.txt" "$out"/b64_*.txt | sed 's/.*: //' | tr -d x \
  | sort -n | awk '{ v[NR] = $1 } END { if (NR) { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
      printf "64 sequences against llama.cpp'"'"'s best at no more GPU memory, %d loads:", NR;
      for (i = 1; i <= NR; i++) printf " %.2fx", v[i]; printf "; median %.2fx\n", m } }' > "$out/summary.txt"
tar -cf "$out/table31.tar" -C "$out" $(cd "$out" && ls | grep -v '^table31.tar$') && \
  (cd "$out" && ls | grep -v '^table31.tar$' | xargs rm -f)
exit 0
