#!/usr/bin/env bash
# On the GPU machine: correctness of strata on CUDA (all-resident, every
# group streamed, partly streamed) against llama.cpp (CUDA) and strata (CPU),
# compute-sanitizer memcheck/racecheck on a short streamed generation, and a
# small side-by-side benchmark with a trace. Results under $OUT.
#   tools/device-gpu-checks.sh MODEL SMALL_MODEL
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:?model}; small=${2:-$1}
out=${OUT:-device-out}; mkdir -p "$out"
source tools/device-bin.sh
fail=0
[ -f $bin/libggml-cuda.so ] || bash tools/build-cuda-module.sh "$bin" 90 2>&1 | tail -3 | tee "$out/build.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/machine.txt"
s() { $bin/strata "$@" 2>&1 | grep -v -e "^load_backend" -e "^ggml_cuda_init" -e "^  Device 0"; return "${PIPESTATUS[0]}"; }
{
  echo "== all resident"; s check -m "$model" --device gpu --with-cpu -n 32 || fail=1
  echo "== every group streamed, 2 slots"; s check -m "$model" --device gpu --with-cpu -n 32 --stream-all --slots 2 || fail=1
  echo "== every group streamed, 3 slots, poisoned slots"; s check -m "$model" --device gpu -n 32 --stream-all --slots 3 --poison-slots || fail=1
  echo "== partly streamed (budget 160M)"; s check -m "$model" --device gpu -n 32 --gpu-budget 160M -c 1024 -b 256 || fail=1
} > "$out/check.txt" 2>&1   # not piped: a pipeline would set `fail` in a subshell
cat "$out/check.txt"
cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -z "$cs" ]; then echo "compute-sanitizer missing: FAIL" | tee "$out/sanitizer.txt"; fail=1; else
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool" | tee -a "$out/sanitizer.txt"
    timeout 240 "$cs" --tool $tool $bin/strata run -m "$small" --device gpu --stream-all --slots 2 -c 256 -b 32 -p "Hello there" -n 4 --temp 0 2>&1 \
      | grep -v "^load_backend" | tail -6 | tee -a "$out/sanitizer.txt"
  done
  grep -q "ERROR SUMMARY: 0 errors" "$out/sanitizer.txt" && grep -q "RACECHECK SUMMARY: 0 hazards" "$out/sanitizer.txt" \
    || { echo "compute-sanitizer reported errors: FAIL"; fail=1; }
fi
{
  echo "== bench all resident vs llama.cpp"
  s bench -m "$model" --device gpu -p 512 -n 64 -B 8 -r 3 --llama-ngl 99,12
  echo "== bench every group streamed"
  s bench -m "$model" --device gpu --stream-all -p 512 -n 64 -B 8 -r 3 --trace "$out/trace_stream_all.json"
} | tee "$out/bench.txt"
# keep the module for the next session (split under the 16 MB per-file limit)
xz -T0 -3 -c $bin/libggml-cuda.so | split -b 15m - "$out/libggml-cuda.so.xz.part-" && cp $bin/libggml-cuda.so.ggml-version "$out/"
ls -la "$out"
exit $fail
