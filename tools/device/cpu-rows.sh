#!/usr/bin/env bash
# On a GPU machine's host: where the host's 64-token expert product spends
# its time (tools/device/cpu-rows-bench.cpp): ggml's one-row Q4_K kernel
# once a row against a multi-row AVX512-VNNI kernel, without and with
# software prefetch, over cold experts (more bytes than the caches) and one
# hot expert, at each of THREADS and ROWS; and `perf stat` of the one-row
# kernel where the machine has perf. Results in $OUT/cpu-rows.txt.
#   here: XZ_BIN=1 tools/device/pack.sh; device: bash tools/device/cpu-rows.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
f=$out/cpu-rows.txt
dev_machine
lscpu | grep -E "Model name|MHz|^Core|^Socket|L1d|L2|L3" | tee "$f"
g++ -std=c++17 -O2 -march=sapphirerapids -w -o /root/cpu-rows-bench tools/device/cpu-rows-bench.cpp -ldl -lpthread 2>&1 | tail -5 | tee -a "$f"
m=$bin/libggml-cpu-sapphirerapids.so
export LD_LIBRARY_PATH=$PWD/$bin
for t in ${THREADS:-1 14}; do
  for r in ${ROWS:-1 4}; do
    for pf in ${PFS:-4608}; do
      THREADS=$t ROWS=$r PF=$pf /root/cpu-rows-bench $m 2>&1 | tee -a "$f"
    done
  done
done
if command -v perf >/dev/null; then
  echo "== perf stat, gemv and rows, 1 thread, 4 rows" | tee -a "$f"
  THREADS=1 ROWS=4 REPS=3 perf stat -e cycles,instructions,cache-misses /root/cpu-rows-bench $m 2>&1 | tail -20 | tee -a "$f"
else
  echo "no perf on this machine" | tee -a "$f"
fi
cat "$out/machine.txt" >> "$f"; rm -f "$out/machine.txt"
exit 0
