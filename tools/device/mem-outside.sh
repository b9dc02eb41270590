#!/usr/bin/env bash
# What the GPU holds beyond the memory plan's items, and whether ggml's CUDA
# graphs are it (runs 211-212: 8238-8284 MiB on an 8 GiB budget where no
# GEMM scratch was reserved). One call: the Qwen3-30B-A3B shape in the
# Q4_K_M mix at 8G (SKEW as tools/device/lib.sh's dev_synth), tg16 and 64
# sequences with the step's debug lines (device memory in use after each
# step against the plan and the activation buffer), four loads:
# `--gemm off` and `--gemm auto`, each with ggml's CUDA graphs and without
# (GGML_CUDA_DISABLE_GRAPHS=1). mem.txt: per load the plan's memory line,
# each row's "GPU N MiB" (the bench's measure: free memory before the load
# less free memory after the test) and the first and last debug lines of
# each step size.
# GEMMS (default "off auto") picks the --gemm settings; where the module was
# built in the call (none in .carry/cuda), it is kept into $OUT/cuda.
#   device: export OUT=$OUT; SKEW=1 [GEMMS=off] bash tools/device/mem-outside.sh
cd "$(dirname "$0")/../.." && source tools/device/lib.sh
dev_machine > "$out/machine.txt"
dev_module_start
s=$(TYPE=q4_k_m dev_synth qwen3-30b-a3b)
dev_module_wait > "$out/module.txt" 2>&1 || exit 1
for gemm in ${GEMMS:-off auto}; do
  for graphs in on off; do
    echo "== --gemm $gemm, CUDA graphs $graphs"
    if [ $graphs = off ]; then export GGML_CUDA_DISABLE_GRAPHS=1; else unset GGML_CUDA_DISABLE_GRAPHS; fi
    STRATA_LOG=strata=info,strata::engine::step=debug timeout 100 $bin/strata bench -m "$s" --device gpu \
      --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -n 16 -B 64 -r 1 --gemm $gemm 2>&1 | quiet \
      | sed 's/\x1b\[[0-9;]*m//g' > /root/load.txt
    grep -E "^memory:|^strata budget|GPU holds" /root/load.txt
    # the first and last "after a step of N tokens" line of each N
    grep "after a step of" /root/load.txt | awk '{n=$8; if (!(n in first)) {first[n]=$0; order[++k]=n} last[n]=$0}
      END {for (i=1; i<=k; i++) {print first[order[i]]; print last[order[i]]}}' | cut -c28-
  done
done > "$out/mem.txt"
dev_keep_module
