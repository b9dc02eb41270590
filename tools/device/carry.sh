#!/usr/bin/env bash
# The carried uploads (`--no-carry` against the default; paging::ring's
# carry_next) and the uploads issued before each host group, on the
# Qwen3-30B-A3B shape in the Q4_K_M mix at 8G (issue 31), one call:
#   export OUT=$OUT; bash tools/device/carry.sh
# 1. parity: `strata check --hybrid off` against llama.cpp all on the GPU,
#    and `check --hybrid 31` with and without carrying (the same figures:
#    carrying changes when weights go up, not what is computed);
# 2. A/B: bench pp2048, tg16, 16 and 64 sequences under each variant of
#    AB (flag sets separated by commas; default "--no-carry," that is
#    without and with carrying), interleaved (ROUNDS rounds, default 2);
# 3. a trace of the 64-sequence step with carrying (trace_b64.json.xz);
# 4. grid: 64 sequences at the plan's own split and with GRID's host
#    groups forced (`--hybrid N`; default "8 9");
# 5. table: issue 31's table, llama.cpp `-ngl 99 --n-cpu-moe N` beside
#    for each N of TABLE_NCM (default 31; "30,31" times both), its
#    defaults and `--no-mmap -ub 2048`; strata with TABLE_FLAGS (e.g.
#    "--expert-split 80"; default none); TABLE_TRACE=1 traces its
#    64-sequence test (trace_table_b64.json.xz);
# 5b. order: which earlier tests of a load slow its 64-sequence steps (the
#    table's load ran them at 365 t/s, loads of their own at 406-419,
#    runs 183-187): strata alone with each test list of ORDER (separated
#    by semicolons; default 64 sequences alone, after pp2048, after tg16 and
#    16 sequences, after all three), ROUNDS rounds interleaved;
# 6. llama: llama.cpp alone (`--no-strata`) at 64 sequences with the
#    experts of NCM layers on the CPU (default 30), both configurations,
#    for its GPU memory and speed at that placement.
# 0. stats (before the others): router counts of 64-sequence steps
#    (`--expert-stats`) written beside the model, which hot experts,
#    routed uploads and the expert split plan from.
# The host CPU's clock is sampled throughout (cpu_clock.txt, dev_clock).
# Env: SKEW (routed skew of the synthetic file; default uniform), STAGES
# (default "check ab trace").
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_machine >/dev/null
dev_clock
dev_module_start
s=$(TYPE=q4_k_m dev_synth qwen3-30b-a3b)
echo "model: $s" > "$out/model.txt"
dev_module_wait
common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
stages=" ${STAGES:-check ab trace} "
if [[ $stages == *" stats "* ]]; then
  timeout 120 $bin/strata bench $common -p 0 -n 0 -B 64 -r 1 --expert-stats 2>&1 | quiet > "$out/stats.txt"
fi
if [[ $stages == *" check "* ]]; then
  {
    echo "== check --hybrid off"
    timeout 200 $bin/strata check -m "$s" --device gpu --gpu-budget 8G -n 16 --hybrid off 2>&1 | quiet
    for c in --no-carry ""; do
      echo "== check --hybrid 31 $c"
      timeout 200 $bin/strata check -m "$s" --device gpu --gpu-budget 8G -n 16 --hybrid 31 $c 2>&1 | quiet
    done
  } > "$out/check.txt"
fi
if [[ $stages == *" ab "* ]]; then
  for r in $(seq 1 "${ROUNDS:-2}"); do
    IFS=, read -ra variants <<< "${AB---no-carry,}"
    [[ ${AB---no-carry,} == *, ]] && variants+=("")
    for c in "${variants[@]}"; do
      dev_mark "ab round $r: $c"
      echo "== round $r: strata bench $common -p 2048 -n 16 -B 16,64 -r 2 $c"
      STRATA_LOG=strata=info timeout 200 $bin/strata bench $common -p 2048 -n 16 -B 16,64 -r 2 $c 2>&1 | quiet
    done
  done > "$out/ab.txt"
fi
if [[ $stages == *" trace "* ]]; then
  timeout 150 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 --trace "$out/trace_b64.json" 2>&1 | quiet > "$out/trace_b64.txt"
  xz -9 "$out/trace_b64.json" 2>/dev/null
fi
if [[ $stages == *" grid "* ]]; then
  for h in auto ${GRID:-8 9}; do
    dev_mark "grid --hybrid $h"
    echo "== strata bench $common -p 0 -n 0 -B 64 -r 2 --hybrid $h"
    STRATA_LOG=strata=info timeout 150 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 --hybrid $h 2>&1 | quiet
  done > "$out/grid.txt"
fi
if [[ $stages == *" order "* ]]; then
  IFS=';' read -ra lists <<< "${ORDER:--p 0 -n 0 -B 64;-p 2048 -n 0 -B 64;-p 0 -n 16 -B 16,64;-p 2048 -n 16 -B 16,64}"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for t in "${lists[@]}"; do
      dev_mark "order round $r: $t"
      echo "== round $r: strata bench $common $t -r 2"
      # shellcheck disable=SC2086 # a test list: flags, split on spaces
      STRATA_LOG=strata=info timeout 200 $bin/strata bench $common $t -r 2 2>&1 | quiet
    done
  done > "$out/order.txt"
fi
if [[ $stages == *" table "* ]]; then
  dev_mark table
  trace=()
  [ "${TABLE_TRACE:-0}" = 1 ] && trace=(--trace "$out/trace_table_b64.json" --trace-test batched64x8)
  # shellcheck disable=SC2086 # TABLE_FLAGS: flags, split on spaces
  STRATA_LOG=strata=info timeout 420 $bin/strata bench $common -p 2048 -n 16 -B 16,64 -r 2 ${TABLE_FLAGS:-} "${trace[@]}" \
    --llama-ngl 99 --llama-best --llama-n-cpu-moe "${TABLE_NCM:-31}" 2>&1 | quiet > "$out/table.txt"
  [ -f "$out/trace_table_b64.json" ] && xz -9 "$out/trace_table_b64.json"
fi
if [[ $stages == *" llama "* ]]; then
  timeout 300 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 --no-strata \
    --llama-ngl 99 --llama-best --llama-n-cpu-moe "${NCM:-30}" 2>&1 | quiet > "$out/llama_ncm${NCM:-30}.txt"
fi
