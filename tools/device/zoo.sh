#!/usr/bin/env bash
# On the GPU machine: the architectures beyond Llama at real shapes (issue
# 26), each on its synthetic Q4_0 model: CUDA parity against llama.cpp all
# on the GPU at a budget that streams at least half of the groups, then
# `strata bench` beside llama.cpp at less GPU memory (its defaults and
# --no-mmap -ub 2048).
#   tools/device/pack.sh VOCAB.gguf        (here), then on the device:
#   bash tools/device/zoo.sh qwen3      # Qwen3-32B shape (17.5 GB): 8G budget; llama.cpp ngl=20
#   bash tools/device/zoo.sh qwen3-check  # its CUDA parity with --hybrid off at 8G, and all resident
#   bash tools/device/zoo.sh qwen3moe   # Qwen3-30B-A3B shape (16.6 GB): parity at 8G --hybrid off, bench at 8G
#                                       # beside llama.cpp ngl=20 and ngl=99 --n-cpu-moe 30
#   bash tools/device/zoo.sh mixtral    # Mixtral-8x7B shape (24.6 GB): parity at 12G --hybrid off, bench at 12G
#                                       # beside llama.cpp ngl=12 and ngl=99 --n-cpu-moe 20
#   bash tools/device/zoo.sh qwen3moe-batch  # the same model at 8G: pp2048 and 64 sequences beside those
#   bash tools/device/zoo.sh gemma3     # Gemma-3-27B shape (16.6 GB): parity at 8G --hybrid off, bench at 8G
#                                       # beside llama.cpp ngl=24
#   bash tools/device/zoo.sh gemma3-swa # Gemma-3-27B shape at 8G, -c 4096: CUDA parity, then pp512, tg16
#                                       # and decode at depth 3500 with the sliding-window layers' KV
#                                       # windowed (the default) and all on the device (--kv-budget
#                                       # 1984M, as before), beside llama.cpp ngl=${NGL:-28}
#   TYPE=q4_k_m bash tools/device/zoo.sh qwen3moe-split  # the 30B shape at 8G, 64 sequences: --expert-split
#                                       # off, auto and forced (SPLITS="..."), then auto beside
#                                       # llama.cpp ngl=99 --n-cpu-moe ${NCM:-31} (defaults, best)
#   SKEW=1 TYPE=q4_k_m bash tools/device/zoo.sh qwen3moe-refresh  # the 30B shape at 8G: hot experts
#                                       # chosen online (--hot-experts 24 --hot-refresh from no counts), then
#                                       # auto from the counts that run saved, and off
#   [SKEW=1] TYPE=q4_k_m bash tools/device/zoo.sh qwen3moe-hot  # the 30B shape at 8G: router counts
#                                       # from a 2048-token prompt (--expert-stats), then tg16 and 64
#                                       # sequences with --hot-experts off, auto and HOTS="..."; LLAMA=1:
#                                       # auto beside llama.cpp ngl=99 --n-cpu-moe ${NCM:-31} (defaults,
#                                       # best) with pp2048 too; TRACE=1: a trace of each
#                                       # configuration's tg16; B=0: no 64-sequence test
#   [SKEW=1] [BS="64 16"] [ROUTED="off auto"] TYPE=q4_k_m bash tools/device/zoo.sh qwen3moe-routed
#                                       # the 30B shape at 8G: router counts from a 2048-token prompt,
#                                       # then B sequences (each of BS) with --routed-uploads X (each of
#                                       # ROUTED; "default": no flag); LLAMA=1: strata's defaults at 64
#                                       # sequences (each of LLAMA_BS) beside
#                                       # llama.cpp ngl=99 --n-cpu-moe ${NCM:-31} (defaults, best); TRACE=1: traces;
#                                       # FLAGS="...": more strata flags (--hybrid off)
#   [GRID="N:S[:h] ..."] [LLAMA=1 [LLAMA_FLAGS=...]] [TRACE=1] TYPE=q4_k_m bash tools/device/zoo.sh qwen3moe-b64
#                                       # the 30B shape at 8G, 64
#                                       # sequences with N whole CPU groups forced (--hybrid N; "default":
#                                       # the plan's) and S slots a ring (--slots S), ":h" adding
#                                       # --cpu-halves; LLAMA=1: then strata (with LLAMA_FLAGS) beside
#                                       # llama.cpp -ngl 99 --n-cpu-moe ${NCM:-31} (defaults, best)
#   [SKEW=1] [GRID="8 12"|none] [ROUNDS=N] [LLAMA=1] TYPE=q4_k_m bash tools/device/zoo.sh qwen3moe-cpuexp
#                                       # the 30B shape at 8G: the host's expert copies repacked and plain
#                                       # (tg16, 16 and 64 sequences, 64 with GRID's whole CPU groups
#                                       # forced), then strata beside llama.cpp (tg32)
#   [SKEW=1] [AHEADS="0 8:1 8:2"] [HOT=X] TYPE=q4_k_m bash tools/device/zoo.sh qwen3moe-ahead  # the
#                                       # 30B shape at 8G: tg16 with --look-ahead N (--look-ahead-layers D)
#                                       # for each N:D of AHEADS, beside --hot-experts X if given
#   [PP=512 SKIP_CHECK=1] bash tools/device/zoo.sh qwen3moe-235b  # Qwen3-235B-A22B shape, Q2_K (77 GB: the two-GPU
#                                       # machine's disk and memory): decode and pp2048 at 24G on the
#                                       # first GPU beside llama.cpp ngl=99 --n-cpu-moe ${NCM:-71}, then
#                                       # CUDA parity at 24G --hybrid off against llama.cpp on every GPU
# The module is fetched (restored or built) while the first model is written;
# a module built here comes back in $OUT/cuda (copy it to .carry-cache/).
# Results under $OUT (one file per mode: a call returns at most 8 files,
# four of them the module's when it was built here).
# SKEW=S (optional, mixtures of experts only): synthesize with
# `--router-skew S` (Zipf-like expert popularity per layer) instead of the
# uniform random router; the model file and the mixture modes' result files
# carry -skewS and their first line says which routing was measured. Run
# once without and once with it to report both.
# SPREAD=1 (qwen3moe-batch): strata again with --resident spread.
# TYPE=q4_k_m (optional): the models in llama.cpp's Q4_K_M mix instead of
# Q4_0 (result files carry -q4_k_m); NGL and NCM (optional) replace the
# mixture modes' llama.cpp layer count and --n-cpu-moe (Q4_K_M's larger
# ffn_down needs one more layer's experts on the CPU to stay under 8G).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_machine
dev_module_start
case ${SKEW:-0} in 0|0.0) SKEW= ;; esac
sk=${SKEW:+-skew$SKEW}
case ${TYPE:-q4_0} in q4_0) ;; *) sk=-$TYPE$sk ;; esac
routing="routing: ${SKEW:+router skew $SKEW (Zipf-like, strata.synth.router_skew)}"
[ -n "$SKEW" ] || routing="routing: uniform (random router, strata.synth.router_skew 0)"
case ${1:-qwen3} in
  qwen3|qwen3-check) first=qwen3-32b ;;
  qwen3moe|qwen3moe-batch|qwen3moe-split|qwen3moe-hot|qwen3moe-b64|qwen3moe-ahead|qwen3moe-routed|qwen3moe-cpuexp) first=qwen3-30b-a3b ;;
  mixtral) first=mixtral-8x7b ;;
  gemma3|gemma3-swa) first=gemma3-27b ;;
  qwen3moe-235b) first=qwen3-235b-a22b; TYPE=${TYPE:-q2_k}; sk=-$TYPE${SKEW:+-skew$SKEW} ;;
  *) first= ;;
esac
case $first in
  qwen3-30b-a3b|mixtral-8x7b|qwen3-235b-a22b) dev_synth $first >/dev/null ;;
  ?*) SKEW= dev_synth $first >/dev/null ;; # dense: no router to skew
esac
dev_module_wait || exit 1
dev_keep_module
for what in ${@:-qwen3}; do
case $what in
  qwen3)
    s=$(SKEW= dev_synth qwen3-32b)
    timeout 200 $bin/strata check -m "$s" --device gpu --gpu-budget 8G -n 16 2>&1 | quiet | tee "$out/zoo_qwen3_check.txt"
    timeout 330 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -p 512 -n 16 -B 0 -r 2 --llama-ngl 20 --llama-best \
      2>&1 | quiet | tee "$out/zoo_qwen3_bench.txt"
    ;;
  qwen3-check)
    # CUDA parity without the host CPU's groups (hybrid decode computes
    # some FFN groups on the CPU, whose kernels round differently), streamed
    # and all resident
    s=$(SKEW= dev_synth qwen3-32b)
    timeout 200 $bin/strata check -m "$s" --device gpu --gpu-budget 8G --hybrid off -n 16 2>&1 | quiet \
      | tee "$out/zoo_qwen3_check_nohybrid.txt"
    timeout 200 $bin/strata check -m "$s" --device gpu -n 16 2>&1 | quiet | tee "$out/zoo_qwen3_check_resident.txt"
    ;;
  qwen3moe|mixtral)
    # CUDA parity with every group on the device, at a budget that streams
    # more than half of them, then strata bench beside llama.cpp: its
    # defaults and --no-mmap -ub 2048 at a layer count under strata's GPU
    # memory, and every layer on the GPU but the first N layers' experts
    # (--n-cpu-moe N, what its users run a mixture of experts with)
    if [ $what = qwen3moe ]; then s=$(dev_synth qwen3-30b-a3b); b=8G; ngl=${NGL:-20}; ncm=${NCM:-30}
    else s=$(dev_synth mixtral-8x7b); b=12G; ngl=${NGL:-12}; ncm=${NCM:-20}; fi
    echo "$routing" | tee "$out/zoo_${what}$sk.txt"
    timeout 150 $bin/strata check -m "$s" --device gpu --gpu-budget $b --hybrid off -n 16 2>&1 | quiet \
      | tee -a "$out/zoo_${what}$sk.txt"
    timeout 300 $bin/strata bench -m "$s" --device gpu --gpu-budget $b -p 512 -n 16 -B 0 -r 2 \
      --llama-ngl $ngl --llama-best --llama-n-cpu-moe $ncm 2>&1 | quiet | tee -a "$out/zoo_${what}$sk.txt"
    ;;
  qwen3moe-batch)
    # decode, pp2048 (steps of 2048, strata's best flag as llama.cpp's) and 64
    # sequences at 8G beside
    # llama.cpp's four configurations
    s=$(dev_synth qwen3-30b-a3b)
    echo "$routing" | tee "$out/zoo_qwen3moe_batch$sk.txt"
    timeout ${BENCH_TIMEOUT:-540} $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 2048 -n 16 -B 64 -r 2 \
      --llama-ngl ${NGL:-20} --llama-best --llama-n-cpu-moe ${NCM:-30} 2>&1 | quiet | tee -a "$out/zoo_qwen3moe_batch$sk.txt"
    # SPREAD=1: strata again with --resident spread (same tests, no llama.cpp)
    if [ "${SPREAD:-0}" = 1 ]; then
      echo "== strata --resident spread" | tee -a "$out/zoo_qwen3moe_batch$sk.txt"
      timeout 150 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 2048 -n 16 -B 64 \
        -r 2 --resident spread 2>&1 | quiet | tee -a "$out/zoo_qwen3moe_batch$sk.txt"
    fi
    ;;
  qwen3moe-split)
    # 64 sequences decoding at 8G: each streamed layer's experts split
    # between the GPU and the host CPU, against whole CPU groups (off), then
    # the default beside llama.cpp's configurations; tg16 to show decode
    # keeps whole CPU groups
    s=$(dev_synth qwen3-30b-a3b); f=$out/zoo_qwen3moe_split$sk.txt
    echo "$routing" | tee "$f"
    common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
    for x in ${SPLITS:-off auto 64 80 96}; do
      echo "== --expert-split $x" | tee -a "$f"
      timeout 200 $bin/strata bench $common -p 0 -n 0 -B 64 -r 2 --expert-split $x 2>&1 | quiet | tee -a "$f"
    done
    echo "== --expert-split auto beside llama.cpp" | tee -a "$f"
    timeout ${BENCH_TIMEOUT:-300} $bin/strata bench $common -p 0 -n 16 -B 64 -r 2 --llama-ngl ${NGL:-18} --llama-best \
      --llama-n-cpu-moe ${NCM:-31} 2>&1 | quiet | tee -a "$f"
    ;;
  qwen3moe-b64)
    # 64 sequences at 8G: whole CPU groups at the 64-token step (forced by
    # --hybrid N: the plan gives the CPU no whole group above its probe's
    # 16 tokens) against the FFN ring's depth (--slots S), to see whether
    # the CPU's groups overlap the bus once the ring holds their time's
    # uploads. GRID="N:S ..." (N off: no CPU group); TRACE=1: a trace of each
    s=$(dev_synth qwen3-30b-a3b); f=$out/zoo_qwen3moe_b64$sk.txt
    echo "$routing" | tee "$f"
    common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -n 0 -B 64 -r 2"
    for x in ${GRID:-off:3 off:5 6:3 6:5 6:7 4:5 8:5 8:7 10:7}; do
      IFS=: read -r n sl hv <<<"$x"
      h="--hybrid $n --slots $sl"; [ $n = default ] && h=
      [ -n "$hv" ] && h="$h --cpu-halves"
      echo "== strata bench $common $h" | tee -a "$f"
      timeout 150 $bin/strata bench $common $h \
        ${TRACE:+--trace $out/trace_b64$sk-$n-$sl${hv:+-halves}.json} 2>&1 | quiet | tee -a "$f"
    done
    if [ -n "${LLAMA:-}" ]; then
      echo "== strata bench $common ${LLAMA_FLAGS:-} --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-31}" | tee -a "$f"
      timeout ${BENCH_TIMEOUT:-240} $bin/strata bench $common ${LLAMA_FLAGS:-} \
        --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-31} 2>&1 | quiet | tee -a "$f"
    fi
    ;;
  qwen3moe-ahead)
    # decode at 8G with the look-ahead: the next host layers' predicted
    # experts uploaded while the host computes (--look-ahead N, N experts
    # a layer at most, D layers ahead: AHEADS="N:D ...", N alone for the
    # default depth; 0: off); HOT=X adds --hot-experts X (auto: router
    # counts from a 2048-token prompt first, as qwen3moe-hot); TRACE=1: a
    # trace of each
    s=$(dev_synth qwen3-30b-a3b); f=$out/zoo_qwen3moe_ahead$sk${HOT:+-hot$HOT}.txt
    echo "$routing" | tee -a "$f"
    common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
    if [ "${HOT:-}" = auto ] && [ ! -f "$s.experts.json" ]; then
      echo "== router counts: strata bench $common -p 2048 -n 0 -B 0 -r 1 --expert-stats" | tee -a "$f"
      timeout 200 $bin/strata bench $common -p 2048 -n 0 -B 0 -r 1 --expert-stats 2>&1 | quiet | tee -a "$f"
    fi
    for x in ${AHEADS:-0 4 8 16}; do
      n=${x%:*}; d=; [ "$x" = "$n" ] || d=${x#*:}
      flags="--look-ahead $n ${d:+--look-ahead-layers $d} ${HOT:+--hot-experts $HOT}"
      echo "== strata bench $common -p 0 -n 16 -B 0 -r ${R:-3} $flags" | tee -a "$f"
      timeout 150 $bin/strata bench $common -p 0 -n 16 -B 0 -r ${R:-3} $flags \
        ${TRACE:+--trace $out/trace_ahead$sk${HOT:+-hot$HOT}-$n-${d:-def}.json} 2>&1 | quiet | tee -a "$f"
    done
    ;;
  qwen3moe-cpuexp)
    # the host CPU's expert copies repacked (the default) against plain
    # memory (--no-repack-experts) at 8G: tg16 and 16 sequences, 64
    # sequences as planned, and 64 with N whole CPU groups forced (--hybrid
    # N --slots 7, for N in GRID, default "8 12"; GRID=none: no 64), the
    # layouts alternated ROUNDS times (default 1); LLAMA=1: then strata's
    # default beside llama.cpp -ngl 99 --n-cpu-moe ${NCM:-31} (its
    # defaults and --no-mmap -ub 2048), tg32
    s=$(dev_synth qwen3-30b-a3b); f=$out/zoo_qwen3moe_cpuexp$sk.txt
    echo "$routing" | tee -a "$f"
    common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -r 2"
    for r in $(seq ${ROUNDS:-1}); do
      for lay in repacked plain; do
        fl=; [ $lay = plain ] && fl=--no-repack-experts
        echo "== round $r, experts $lay: strata bench $common -n 16 -B 16 $fl" | tee -a "$f"
        timeout 150 $bin/strata bench $common -n 16 -B 16 $fl 2>&1 | quiet | tee -a "$f"
        [ "${GRID:-}" = none ] && continue
        for n in default ${GRID:-8 12}; do
          h="--hybrid $n --slots 7"; [ $n = default ] && h=
          echo "== round $r, experts $lay: strata bench $common -n 0 -B 64 $h $fl" | tee -a "$f"
          timeout 150 $bin/strata bench $common -n 0 -B 64 $h $fl 2>&1 | quiet | tee -a "$f"
        done
      done
    done
    if [ -n "${LLAMA:-}" ]; then
      echo "== strata bench $common -n 32 -B 0 --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-31}" | tee -a "$f"
      timeout ${BENCH_TIMEOUT:-240} $bin/strata bench $common -n 32 -B 0 \
        --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-31} 2>&1 | quiet | tee -a "$f"
    fi
    ;;
  qwen3moe-routed)
    # routed uploads at 8G: router counts from a 2048-token prompt
    # (--expert-stats, saved beside the model; every run after adds its
    # own), then B sequences decoding with the streamed mixture layers
    # uploading whole groups (off) or only their picked experts
    s=$(dev_synth qwen3-30b-a3b); f=$out/zoo_qwen3moe_routed$sk.txt
    echo "$routing" | tee -a "$f"
    common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
    if [ ! -f "$s.experts.json" ]; then
      echo "== router counts: strata bench $common -p 2048 -n 0 -B 0 -r 1 --expert-stats" | tee -a "$f"
      timeout 200 $bin/strata bench $common -p 2048 -n 0 -B 0 -r 1 --expert-stats 2>&1 | quiet | tee -a "$f"
    fi
    for bb in ${BS:-64 16}; do
      for x in ${ROUTED:-off auto}; do
        flag="--routed-uploads $x"; [ $x = default ] && flag=
        echo "== strata bench $common -p 0 -n 0 -B $bb -r 2 $flag ${FLAGS:-}" | tee -a "$f"
        timeout 150 $bin/strata bench $common -p 0 -n 0 -B $bb -r 2 $flag ${FLAGS:-} \
          ${TRACE:+--trace $out/trace_routed$sk-$bb-$x.json} 2>&1 | quiet | tee -a "$f"
      done
    done
    if [ -n "${LLAMA:-}" ]; then
      for bb in ${LLAMA_BS:-64}; do
        echo "== strata bench $common -p 0 -n 0 -B $bb -r 2 --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-31}" | tee -a "$f"
        timeout ${BENCH_TIMEOUT:-240} $bin/strata bench $common -p 0 -n 0 -B $bb -r 2 \
          --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-31} 2>&1 | quiet | tee -a "$f"
      done
    fi
    ;;
  qwen3moe-hot)
    # hot experts at 8G: the router counts a 2048-token prompt of random
    # tokens gives (saved beside the model), then decode and 64 sequences
    # with the pool off, auto and forced
    s=$(dev_synth qwen3-30b-a3b); f=$out/zoo_qwen3moe_hot$sk.txt
    echo "$routing" | tee -a "$f"
    common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
    if [ ! -f "$s.experts.json" ]; then
      echo "== router counts: strata bench $common -p 2048 -n 0 -B 0 -r 1 --expert-stats" | tee -a "$f"
      timeout 200 $bin/strata bench $common -p 2048 -n 0 -B 0 -r 1 --expert-stats 2>&1 | quiet | tee -a "$f"
    fi
    for x in ${HOTS-off auto 24}; do
      echo "== --hot-experts $x: strata bench $common -p 0 -n 16 -B ${B:-64} -r 2 --hot-experts $x" | tee -a "$f"
      timeout 200 $bin/strata bench $common -p 0 -n 16 -B ${B:-64} -r 2 --hot-experts $x \
        ${TRACE:+--trace $out/trace_hot$sk-$x.json} 2>&1 | quiet | tee -a "$f"
    done
    if [ -n "${LLAMA:-}" ]; then
      echo "== --hot-experts auto beside llama.cpp" | tee -a "$f"
      timeout ${BENCH_TIMEOUT:-360} $bin/strata bench $common -p 2048 -n 16 -B 64 -r 2 --hot-experts auto \
        --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-31} 2>&1 | quiet | tee -a "$f"
    fi
    ;;
  qwen3moe-refresh)
    # hot experts chosen online: no counts file, 24 experts a layer forced
    # (the first ones), re-chosen from the router's picks after each
    # repetition (--hot-refresh, what serve does between requests); the
    # counts the run made are saved, and a second load plans --hot-experts
    # auto from them; the pool off beside them
    s=$(dev_synth qwen3-30b-a3b); f=$out/zoo_qwen3moe_refresh$sk.txt
    rm -f "$s.experts.json"
    echo "$routing" | tee "$f"
    common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048 -p 0 -n 16 -B 0"
    for x in "24 --hot-refresh -r ${R:-5}" "auto -r 3" "off -r 3"; do
      echo "== strata bench $common --hot-experts $x" | tee -a "$f"
      timeout 200 $bin/strata bench $common --hot-experts $x 2>&1 | quiet | tee -a "$f"
    done
    ;;
  gemma3)
    s=$(SKEW= dev_synth gemma3-27b)
    timeout 150 $bin/strata check -m "$s" --device gpu --gpu-budget 8G --hybrid off -n 16 2>&1 | quiet \
      | tee "$out/zoo_gemma3.txt"
    timeout 300 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -p 512 -n 16 -B 0 -r 2 \
      --llama-ngl 24 --llama-best 2>&1 | quiet | tee -a "$out/zoo_gemma3.txt"
    ;;
  gemma3-swa)
    s=$(SKEW= dev_synth gemma3-27b); f=$out/zoo_gemma3_swa.txt
    echo "== strata check --gpu-budget 8G --hybrid off -c 4096" | tee "$f"
    timeout 150 $bin/strata check -m "$s" --device gpu --gpu-budget 8G -c 4096 --hybrid off -n 16 2>&1 | quiet | tee -a "$f"
    for kv in "" "--kv-budget 1984M"; do
      echo "== strata ${kv:-(default: sliding-window layers windowed)}; llama.cpp with the first" | tee -a "$f"
      llama="--llama-ngl ${NGL:-28} --llama-best"; [ -z "$kv" ] || llama=
      timeout 300 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -c 4096 $kv -p 512 -n 16 -B 0 -r 2 \
        $llama 2>&1 | quiet | tee -a "$f"
      timeout 200 $bin/strata bench -m "$s" --device gpu --gpu-budget 8G -c 4096 $kv -p 0 -n 16 -B 0 -r 2 \
        --depth 3500 $llama 2>&1 | quiet | tee -a "$f"
    done
    ;;
  qwen3moe-235b)
    # the bench on the first GPU alone (llama.cpp would split its layers
    # over every GPU it sees), then parity with llama.cpp all on the GPUs
    # (77 GB: every GPU of the machine), strata on the first at 24G
    s=$(dev_synth qwen3-235b-a22b)
    echo "$routing" | tee "$out/zoo_qwen3moe_235b$sk.txt"
    # PP=512: the prompt test at 512 tokens (steps of 512) instead of 2048;
    # SKIP_CHECK=1: the bench alone
    pp=${PP:-2048}
    CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-400} $bin/strata bench -m "$s" --device gpu --gpu-budget 24G -c 4096 \
      -b $pp -ub $pp -p $pp -n 16 -B 0 -r 2 --llama-ngl 99 --llama-best --llama-n-cpu-moe ${NCM:-71} 2>&1 | quiet \
      | tee -a "$out/zoo_qwen3moe_235b$sk.txt"
    [ "${SKIP_CHECK:-0}" = 1 ] && continue
    echo "== strata check --gpu-budget 24G --hybrid off (llama.cpp on $(nvidia-smi -L | wc -l) GPUs)" \
      | tee -a "$out/zoo_qwen3moe_235b$sk.txt"
    timeout ${CHECK_TIMEOUT:-150} $bin/strata check -m "$s" --device gpu --gpu-budget 24G --hybrid off -n 16 2>&1 | quiet \
      | tee -a "$out/zoo_qwen3moe_235b$sk.txt"
    ;;
  *) echo "zoo.sh: unknown mode $what (qwen3, qwen3-check, qwen3moe, qwen3moe-batch, mixtral, gemma3, gemma3-swa, qwen3moe-235b)" >&2; exit 2 ;;
esac
done
