#!/usr/bin/env bash
# On the GPU machine: what speculative decoding costs at a 12 GB (or 24 GB)
# budget. The 70B-shaped Q4_0 model streams; a Llama-3.2-1B-shaped Q4_0
# draft with the same vocabulary stays resident (its memory comes out of the
# budget). Per k (drafts verified per step): the target step with 1 + k
# tokens and the draft's time for k tokens; plain decode with and without
# the draft's share of the budget; llama.cpp decode beside it.
#   tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/spec.sh            # all: 12G, k = 0,1,4,8,16 with the draft (trace of k = 16),
#                                        # then without it; llama.cpp ngl=24 with its defaults
#   bash tools/device/spec.sh llama      # plain strata tg beside llama.cpp ngl=24,
#                                        # default settings and strata-matched
#   bash tools/device/spec.sh hybrid     # 12G, k = 0,1,2,4,8,16, hybrid decode on and off; llama.cpp ngl=24
#   bash tools/device/spec.sh hybrid24   # the same at 24G; llama.cpp ngl=44
# Several may be named in one call. REPS (default 3) repetitions per bench.
# Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
m=$(dev_synth llama3-70b); d=$(dev_synth llama3.2-1b)
dev_module_wait || exit 1
R=${REPS:-3}
for what in ${@:-all}; do
case $what in
all)
  {
    echo "== 12G budget, draft resident: target step with 1+k tokens, draft time for k tokens; plain tg"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -md "$d" -p 0 -n 16 -B 0 -r $R --spec-k 0,1,4,8,16 \
      --trace "$out/trace_spec_k16.json" 2>&1 | quiet
    echo "== 12G budget, no draft: plain tg and the 1+k-token step"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 16 -B 0 -r $R --spec-k 0,4,8,16 2>&1 | quiet
    echo "== llama.cpp ngl=24 with its default settings (repacking on, flash attention auto), same file"
    $bin/strata bench -m "$m" --device gpu --no-strata -p 0 -n 16 -B 0 -r $R --llama-ngl 24 2>&1 | quiet
  } | tee "$out/spec_12g.txt" ;;
llama)
  {
    echo "== strata 12G plain tg; llama.cpp ngl=24 with its defaults (repacking on, flash attention auto), then configured like strata"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G -p 0 -n 16 -B 0 -r $R --llama-ngl 24 2>&1 | quiet
    $bin/strata bench -m "$m" --device gpu --no-strata -p 0 -n 16 -B 0 -r $R --llama-ngl 24 --llama-match 2>&1 | quiet
  } | tee "$out/llama_12g.txt" ;;
hybrid|hybrid24)
  if [ "$what" = hybrid ]; then b=12G; ngl=24; else b=24G; ngl=44; fi
  {
    echo "== $b, hybrid auto, draft resident: the target step with 1+k tokens, the draft's time for k tokens"
    $bin/strata bench -m "$m" --device gpu --gpu-budget $b -md "$d" -p 0 -n 16 -B 0 -r $R --spec-k 0,1,2,4,8,16 \
      --trace "$out/trace_spec_hybrid_${b}_k16.json" 2>&1 | quiet
    echo "== $b, hybrid off, draft resident"
    $bin/strata bench -m "$m" --device gpu --gpu-budget $b --hybrid off -md "$d" -p 0 -n 0 -B 0 -r $R --spec-k 0,4,8,16 2>&1 | quiet
    echo "== llama.cpp ngl=$ngl with its default settings, same file"
    $bin/strata bench -m "$m" --device gpu --no-strata -p 0 -n 16 -B 0 -r $R --llama-ngl $ngl 2>&1 | quiet
  } 2>&1 | tee "$out/spec_hybrid_$b.txt" ;;
*) echo "spec.sh: unknown mode $what (all llama hybrid hybrid24)" >&2; exit 2 ;;
esac
done
