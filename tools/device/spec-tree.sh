#!/usr/bin/env bash
# On the GPU machine: speculative decoding with token trees on the
# 70B-shaped Q4_0 model, a Llama-3.2-1B-shaped Q4_0 draft resident (its
# memory comes out of the budget).
#   tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/spec-tree.sh curve    # 12G: the verifying step of 1+k rows (a tree of k
#                                           # nodes the draft grew) and the draft's time for it,
#                                           # k = $K; hybrid decode auto and off
#   bash tools/device/spec-tree.sh replay   # 12G and 24G (replay12, replay24: one of them):
#                                           # tokens/s measured end to end at the
#                                           # acceptance of each trace in $TRACES (recorded on the
#                                           # Qwen2.5-Coder pair by `bench --spec-accept --spec-record`);
#                                           # llama.cpp's own speculative decoding at ngl 24 / 44 with
#                                           # the same draft, at $LLAMA_TRACE's acceptance (chains),
#                                           # with its defaults and with --no-mmap (--llama-best)
# Several may be named in one call. REPS (default 3) repetitions per step.
# N (default 64) tokens per category per replay. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
m=$(dev_synth llama3-70b); d=$(dev_synth llama3.2-1b)
dev_module_wait || exit 1
R=${REPS:-3}
K=${K:-0,1,2,4,8,16,32,64,128,256,512}
N=${N:-64}
TR=docs/device/spec-tree/traces
TRACES=${TRACES:-$TR/chain-llama-defaults.json $TR/chain16.json $TR/tree16.json $TR/tree64.json $TR/tree128.json}
LLAMA_TRACE=${LLAMA_TRACE:-$TR/chain-llama-defaults.json}
for what in "$@"; do
case $what in
curve)
  for hy in auto off; do
    echo "== 12G, hybrid $hy, draft resident: the verifying step of 1+k rows (a tree of k nodes), the draft's time to grow it"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --hybrid $hy -md "$d" --draft-tree 512 \
      -p 0 -n 0 -B 0 -r $R --spec-k $K 2>&1 | quiet
  done 2>&1 | tee "$out/curve_12g.txt" ;;
replay|replay12|replay24)
  case $what in replay) bns="12G:24 24G:44" ;; replay12) bns=12G:24 ;; *) bns=24G:44 ;; esac
  for bn in $bns; do
    b=${bn%%:*}; ngl=${bn#*:}
    {
      echo "== $b, draft resident: plain decode and speculative decoding at each trace's acceptance"
      $bin/strata bench -m "$m" --device gpu --gpu-budget $b -md "$d" -p 0 -n 0 -B 0 \
        --spec-replay "$(echo $TRACES | tr ' ' ',')" --spec-replay-n $N 2>&1 | quiet | grep -E "spec replay|^plan|^memory|^draft|error"
      echo "== llama.cpp ngl=$ngl with its defaults and with --no-mmap, the same draft all on the GPU: verify step, speculative decoding at $LLAMA_TRACE's acceptance"
      $bin/strata bench -m "$m" --device gpu --no-strata -md "$d" -p 0 -n 0 -B 0 -r $R --spec-k 0,1,4,8,16 \
        --spec-replay "$LLAMA_TRACE" --spec-replay-n $N --llama-ngl $ngl --llama-best 2>&1 | quiet
    } 2>&1 | tee "$out/replay_$b.txt"
  done ;;
*) echo "spec-tree.sh: unknown mode $what (curve replay replay12 replay24)" >&2; exit 2 ;;
esac
done
