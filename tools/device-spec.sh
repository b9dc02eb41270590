#!/usr/bin/env bash
# On the GPU machine: what speculative decoding costs at a 12 GB budget.
# The 70B-shaped Q4_0 model streams; a Llama-3.2-1B-shaped Q4_0 draft with
# the same vocabulary stays resident (its memory comes out of the budget).
# Per k (drafts verified per step): the target step with 1 + k tokens and
# the draft's time for k tokens; plain decode with and without the draft's
# share of the budget; llama.cpp ngl=24 decode beside it.
#   tools/pack-device.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device-spec.sh          # all of it (REPS=7 for 7 repetitions)
#   bash tools/device-spec.sh llama    # plain strata tg beside llama.cpp ngl=24,
#                                      # default settings and strata-matched
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}; mkdir -p "$out"
source tools/device-bin.sh; v=.carry/models/vocab-smollm2.gguf
mkdir -p /root/m
f() { grep -v -e "^load_backend" -e "^ggml_cuda_init" -e "^  Device 0"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/machine.txt"
# the CUDA module builds (4 minutes on 16 cores) while the models are written
[ -f $bin/libggml-cuda.so ] || { bash tools/device-restore-module.sh > "$out/module.txt" 2>&1 & }
m=/root/m/llama3-70b-q4_0.gguf; d=/root/m/llama3.2-1b-q4_0.gguf
[ -f "$m" ] || $bin/strata-convert synth --preset llama3-70b --type q4_0 --vocab-from $v "$m" 2>&1 | tail -1 | tee "$out/synth.txt"
[ -f "$d" ] || $bin/strata-convert synth --preset llama3.2-1b --type q4_0 --vocab-from $v "$d" 2>&1 | tail -1 | tee -a "$out/synth.txt"
wait
tail -2 "$out/module.txt"
if [ "${1:-all}" = llama ]; then
  {
    echo "== strata 12G plain tg; llama.cpp ngl=24 with its defaults (repacking on, flash attention auto), then configured like strata"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 16 -B 0 -r ${REPS:-3} --llama-ngl 24 2>&1 | f
    $bin/strata bench -m "$m" --device gpu --no-strata -p 0 -n 16 -B 0 -r ${REPS:-3} --llama-ngl 24 --llama-match 2>&1 | f
  } | tee "$out/llama_12g.txt"
  exit 0
fi
{
  echo "== 12G budget, draft resident: target step with 1+k tokens, draft time for k tokens; plain tg"
  $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -md "$d" -p 0 -n 16 -B 0 -r ${REPS:-3} --spec-k 0,1,4,8,16 \
    --trace "$out/trace_spec_k16.json" 2>&1 | f
  echo "== 12G budget, no draft: plain tg and the 1+k-token step"
  $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 16 -B 0 -r ${REPS:-3} --spec-k 0,4,8,16 2>&1 | f
  echo "== llama.cpp ngl=24 with its default settings (repacking on, flash attention auto), same file"
  $bin/strata bench -m "$m" --device gpu --no-strata -p 0 -n 16 -B 0 -r ${REPS:-3} --llama-ngl 24 2>&1 | f
} | tee "$out/spec_12g.txt"
