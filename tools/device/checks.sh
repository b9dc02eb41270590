#!/usr/bin/env bash
# On the GPU machine: strata on CUDA against llama.cpp on CUDA and strata on
# the CPU, after a change to the engine or to how ggml is built or bound.
#   tools/device/pack.sh [MODEL.gguf | VOCAB.gguf]   (here), then on the device:
#   bash tools/device/checks.sh model MODEL [SMALL]
#       a real model: all resident, every group streamed (2 slots; 3 slots
#       poisoned), partly streamed (budget 160M); compute-sanitizer memcheck
#       and racecheck on a short streamed run of SMALL (default MODEL); a
#       small bench beside llama.cpp with a trace. Exits 1 on any failure.
#   bash tools/device/checks.sh synth
#       synthetic llama3-8b (8 layers) and qwen2.5-7b (4 layers), resident
#       and every group streamed; 8 greedy tokens of the 70B-shaped model at 12G
#   bash tools/device/checks.sh streamed
#       every group streamed on the GPU only (--hybrid off: the CPU's groups
#       round differently from CUDA's kernels); the 12G 64-sequence bench
#       beside llama.cpp ngl=24 with its defaults
# synth and streamed may be named together (synth streamed). A CUDA module
# built here comes back in $OUT/cuda/ for .carry-cache/. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh

# s ARGS...: strata ARGS, log filtered, strata's exit status kept
s() { $bin/strata "$@" 2>&1 | quiet; return "${PIPESTATUS[0]}"; }

check_model() {
  local model=$1 small=${2:-$1} fail=0 cs tool
  dev_machine
  dev_module || exit 1
  {
    echo "== all resident"; s check -m "$model" --device gpu --with-cpu -n 32 || fail=1
    echo "== every group streamed, 2 slots"; s check -m "$model" --device gpu --with-cpu -n 32 --stream-all --slots 2 || fail=1
    echo "== every group streamed, 3 slots, poisoned slots"; s check -m "$model" --device gpu -n 32 --stream-all --slots 3 --poison-slots || fail=1
    echo "== partly streamed (budget 160M)"; s check -m "$model" --device gpu -n 32 --gpu-budget 160M -c 1024 -b 256 || fail=1
  } > "$out/check.txt" 2>&1   # not piped: a pipeline would set `fail` in a subshell
  cat "$out/check.txt"
  cs=$(dev_sanitizer)
  if [ -z "$cs" ]; then echo "compute-sanitizer missing: FAIL" | tee "$out/sanitizer.txt"; fail=1; else
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool" | tee -a "$out/sanitizer.txt"
      timeout 240 "$cs" --tool $tool $bin/strata run -m "$small" --device gpu --stream-all --slots 2 -c 256 -b 32 \
        -p "Hello there" -n 4 --temp 0 2>&1 | quiet | tail -6 | tee -a "$out/sanitizer.txt"
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
  dev_keep_module
  ls -la "$out"
  exit $fail
}

if [ "${1:-}" = model ]; then
  shift
  check_model "${1:?usage: checks.sh model MODEL [SMALL]}" "${2:-}"
fi
usage() { echo "usage: checks.sh model MODEL [SMALL] | checks.sh synth|streamed..." >&2; exit 2; }
[ $# -gt 0 ] || usage
for what in "$@"; do case $what in synth|streamed) ;; *) usage ;; esac; done
dev_70b || exit 1
for what in "$@"; do
case $what in
synth)
  dev_keep_module
  for spec in "llama3-8b 8" "qwen2.5-7b 4"; do
    set -- $spec
    small=$(dev_synth $1 $2)
    echo "== $1 ($2 layers) resident"; s check -m "$small" --device gpu --with-cpu -n 16 -c 512
    echo "== $1 ($2 layers) every group streamed"; s check -m "$small" --device gpu --with-cpu -n 16 -c 512 --stream-all --slots 2
  done 2>&1 | tee "$out/check_small.txt"
  echo "== 70B greedy tokens at 12G"
  s run -m "$m" --device gpu --gpu-budget 12G -c 1024 -p "The capital of France is" -n 8 --temp 0 | tee "$out/run_70b.txt"
  ;;
streamed)
  s8=$(dev_synth llama3-8b 8)
  echo "== llama3-8b (8 layers) every group streamed, hybrid off"
  s check -m "$s8" --device gpu -n 16 -c 512 --stream-all --slots 2 --hybrid off | tee "$out/check_streamed_gpu_only.txt"
  echo "== 12G: strata bench, 64 sequences x 8 decode steps after 16-token prompts; llama.cpp ngl=24 (defaults)"
  s bench -m "$m" --device gpu --gpu-budget 12G -c 4096 -b 512 -p 0 -n 0 -B 64 -r 2 --llama-ngl 24 | tee "$out/bench_12g.txt"
  ;;
esac
done
