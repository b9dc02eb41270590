#!/usr/bin/env bash
# On the two-GPU machine (nvidia-h200-x2 / nvidia-h100-x2): where a prompt
# step's GPU time goes, kernel by kernel, in the row split at 12G on each
# GPU against one GPU at 12G (issue 28), from Nsight Systems (nsys, where
# the machine has it): the 70B-shaped Q4_0, `-p 2048 -b 2048 -ub 2048 -n 0
# -B 0 -r 4` (TESTS replaces it), each configuration profiled alone and
# summed by tools/device/kernel-sum.py over its last step. CONFIGS picks
# (default "row one"). Results in $OUT/profile.txt (and the CUPTI
# records in cupti_CONFIG.tsv.gz); the CUDA module comes
# back in $OUT/cuda where it was built here.
#   XZ_BIN=1 tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/row-profile.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
source tools/device/cupti-trace.sh
dev_70b || exit 1
dev_keep_module
f=$out/profile.txt
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys \
  /usr/local/cuda*/nsight-systems*/bin/nsys /opt/nvidia/nsight-systems*/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${nsys:-none found}" | tee "$f"
[ -n "$nsys" ] && "$nsys" --version 2>&1 | head -1 | tee -a "$f"
cupti=
[ -n "$nsys" ] || { cupti_build 2>&1 | tee -a "$f"; [ -f /root/cupti-trace.so ] && cupti=/root/cupti-trace.so; }
tests=${TESTS:-"-p 2048 -b 2048 -ub 2048 -n 0 -B 0 -r 4"}
for c in ${CONFIGS:-row one}; do
  flags=$(dev_split_flags $c) || exit 2
  echo "== $c: strata bench --gpu-budget 12G $flags $tests" | tee -a "$f"
  if [ -z "$nsys" ]; then
    run=(); [ -n "$cupti" ] && run=(env CUDA_INJECTION64_PATH=$cupti CUPTI_TRACE_OUT=/root/trace-$c.tsv)
    timeout 200 "${run[@]}" $bin/strata bench -m "$m" --device gpu --gpu-budget 12G $flags $tests 2>&1 | quiet |
      grep -e "pp[0-9]" -e rror | tee -a "$f"
    [ -n "$cupti" ] || continue
    python3 tools/device/kernel-sum.py /root/trace-$c.tsv 2>&1 | tee -a "$f"
    gzip -c /root/trace-$c.tsv > "$out/cupti_$c.tsv.gz"
    continue
  fi
  timeout 300 "$nsys" profile -o /root/prof-$c --force-overwrite true --trace=cuda --cuda-graph-trace=node \
    --sample=none --cpuctxsw=none $bin/strata bench -m "$m" --device gpu --gpu-budget 12G $flags $tests 2>&1 |
    quiet | grep -e "pp[0-9]" -e rror -e "^Generat" -e "nsys" | tee -a "$f"
  "$nsys" export --type sqlite -o /root/prof-$c.sqlite --force-overwrite true /root/prof-$c.nsys-rep >/dev/null 2>&1
  python3 tools/device/kernel-sum.py /root/prof-$c.sqlite 2>&1 | tee -a "$f"
done
