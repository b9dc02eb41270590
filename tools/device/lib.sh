# The steps every device run shares, sourced (not run) by tools/device/*.sh
# on the GPU machine, which has no Rust, no network and no apt: the carried
# binaries, the CUDA module, the synthetic models, the machine's description
# and the log filter. Sourcing sets $out and $bin (unpacking
# .carry/bin.tar.xz where `XZ_BIN=1 tools/device/pack.sh` packed it) and
# runs nothing else.
#   cd "$(dirname "$0")/../.." && source tools/device/lib.sh
#   dev_70b                       # machine.txt, CUDA module, 70B-shaped model in $m
#   s8=$(dev_synth llama3-8b 8)   # a synthetic model, cut to 8 layers
#   ... 2>&1 | quiet | tee "$out/X.txt"
# Env: OUT (results; default ./device-out), VOCAB (the vocabulary GGUF of
# the synthetic models; default .carry/models/vocab-smollm2.gguf or its
# .xz), CUDA_ARCHS (when the module is built; default 90). What outlives a
# call while the machine stays warm: /root/m (models), /root/cuda (module).

out=${OUT:-device-out}; mkdir -p "$out"
bin=.carry/bin
[ -d $bin ] || tar -xJf .carry/bin.tar.xz -C .carry
mkdir -p /root/m /root/cuda

# quiet: drops ggml's backend-loading lines from a log on stdin.
quiet() { grep -v -e "^load_backend" -e "^ggml_cuda_init" -e "^  Device 0"; }

# dev_machine: the GPU, CPU, disk and memory into $out/machine.txt.
dev_machine() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm \
      --format=csv,noheader
    lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|Flags" | cut -c1-200
    df -h /root | tail -1
    free -g | head -2
    echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)," \
      "defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null)"
  } > "$out/machine.txt" 2>&1
  head -2 "$out/machine.txt"
}

# dev_clock [SECONDS]: samples the host CPU every SECONDS (default 2) into
# $out/cpu_clock.txt until the run ends: the time, the mean, lowest and
# highest MHz over the cores (cpufreq where the machine has it, else
# /proc/cpuinfo, which a VM may report as fixed: the H200 VM of runs
# 188-192 reports 2100 MHz on every core), then, from /proc/stat over the
# interval, the share of all cores' time busy (user, nice, system, irq)
# and stolen by the hypervisor (steal). `dev_mark TEXT` writes a line
# there, so a stage's samples can be found.
dev_clock() {
  local every=${1:-2}
  (
    local prev now
    prev=$(head -1 /proc/stat)
    while sleep "$every"; do
      local f
      f=$(cat /sys/devices/system/cpu/cpu*/cpufreq/scaling_cur_freq 2>/dev/null | awk '{print $1 / 1000}')
      [ -n "$f" ] || f=$(awk -F: '/^cpu MHz/ {print $2}' /proc/cpuinfo)
      now=$(head -1 /proc/stat)
      echo "$f" | awk -v t="$(date +%T)" -v a="$prev" -v b="$now" '{s += $1; n++; if (n == 1 || $1 < lo) lo = $1; if ($1 > hi) hi = $1}
        END {split(a, x, " "); split(b, y, " "); tot = 0
          for (i = 2; i <= 9; i++) tot += y[i] - x[i]
          busy = (y[2] - x[2]) + (y[3] - x[3]) + (y[4] - x[4]) + (y[7] - x[7]) + (y[8] - x[8])
          steal = y[9] - x[9]
          if (n) printf "%s %.0f %.0f %.0f busy %.0f%% steal %.1f%%\n", t, s / n, lo, hi,
            tot ? 100 * busy / tot : 0, tot ? 100 * steal / tot : 0}'
      prev=$now
    done
  ) >> "$out/cpu_clock.txt" 2>/dev/null &
}
dev_mark() { echo "$(date +%T) == $*" >> "$out/cpu_clock.txt"; }

# dev_vocab: prints the path of the vocabulary GGUF the synthetic models take
# their tokenizer from (the carried one may travel xz-compressed: with a
# CUDA module in .carry/cuda the carry is close to its 64 MiB).
dev_vocab() {
  local v=${VOCAB:-.carry/models/vocab-smollm2.gguf}
  if [ -f "$v" ]; then echo "$v"; return; fi
  xz -dc "$v.xz" > /root/m/.vocab.tmp && mv /root/m/.vocab.tmp /root/m/vocab.gguf
  echo /root/m/vocab.gguf
}

# dev_synth PRESET [LAYERS]: prints the path of the model `strata-convert
# synth --preset PRESET --type $TYPE` makes (TYPE: q4_0 unless set, q4_k_m
# for llama.cpp's Q4_K_M mix), cut to LAYERS layers, in /root/m, writing it
# only where this machine lacks it (the 70B one takes 30-70 s; its last log
# line goes to $out/synth.txt). The written file's dirty pages are flushed
# before anything is timed (hybrid run 14: the CPU read 64.5 GB/s during
# the writeback, 90 a minute later). With SKEW set and not 0 (mixtures of
# experts), the router is skewed (--router-skew $SKEW) and the file name
# says so (PRESET-TYPE-skew$SKEW.gguf), so uniform and skewed files coexist.
dev_synth() {
  local preset=$1 layers=${2:-} skew=${SKEW:-0} ty=${TYPE:-q4_0} p
  if [ -n "$layers" ]; then p=/root/m/$preset-$layers; else p=/root/m/$preset-$ty; fi
  [ -z "$layers" ] || [ "$ty" = q4_0 ] || p=$p-$ty
  case $skew in 0|0.0|"") skew= ;; esac
  p=$p${skew:+-skew$skew}.gguf
  if [ ! -f "$p" ]; then
    $bin/strata-convert synth --preset "$preset" --type "$ty" ${layers:+--layers "$layers"} \
      ${skew:+--router-skew "$skew"} --vocab-from "$(dev_vocab)" "$p" 2>&1 | tail -1 >> "$out/synth.txt"
    sync
  fi
  echo "$p"
}

# dev_module_ok DIR: whether DIR holds a CUDA module whose version stamp
# names this checkout's vendor/ source: the archive and the patches the
# module is built from (`source.sh id cuda`; strata refuses any other).
dev_module_ok() {
  [ -f "$1/libggml-cuda.so" ] &&
    [ "$(sed -n 2p "$1/libggml-cuda.so.ggml-version" 2>/dev/null)" = "$(bash vendor/source.sh id cuda)" ]
}

# dev_module_get: makes /root/cuda hold the CUDA module: kept from an earlier
# call on this machine, else restored from the xz parts tools/device/pack.sh
# carried in .carry/cuda, else built from vendor/ by
# tools/build-cuda-module.sh (about 4 minutes on 16 cores). Records which in
# /root/cuda/origin (restored or built).
dev_module_get() {
  local t0
  if dev_module_ok /root/cuda; then
    echo "CUDA module: the one in /root/cuda ($(cat /root/cuda/origin 2>/dev/null), $(paste -sd' ' /root/cuda/libggml-cuda.so.ggml-version))"
    return 0
  fi
  if ls .carry/cuda/libggml-cuda.so.xz.part-* >/dev/null 2>&1; then
    cat .carry/cuda/libggml-cuda.so.xz.part-* | xz -d > /root/cuda/libggml-cuda.so
    cp .carry/cuda/libggml-cuda.so.ggml-version /root/cuda/
    if dev_module_ok /root/cuda; then
      echo restored > /root/cuda/origin
      echo "restored libggml-cuda.so from .carry/cuda ($(paste -sd' ' /root/cuda/libggml-cuda.so.ggml-version))"
      return 0
    fi
    echo "the module in .carry/cuda was built from another vendor/ source: building"
  fi
  t0=$(date +%s)
  bash tools/build-cuda-module.sh /root/cuda "${CUDA_ARCHS:-90}" || return 1
  echo built > /root/cuda/origin
  echo "module build: $(( $(date +%s) - t0 )) s"
}

# dev_module: dev_module_get (logged to $out/module.txt), then the module
# beside the binaries.
dev_module() {
  dev_module_get 2>&1 | tee -a "$out/module.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || return 1
  cp /root/cuda/libggml-cuda.so /root/cuda/libggml-cuda.so.ggml-version $bin/
}

# dev_module_start, dev_module_wait: the same, in the background (the
# models are written meanwhile).
dev_module_start() {
  dev_module_get >> "$out/module.txt" 2>&1 &
  DEV_MODULE_PID=$!
}
dev_module_wait() {
  wait "$DEV_MODULE_PID"; local rc=$?
  tail -2 "$out/module.txt"
  [ $rc = 0 ] || return 1
  cp /root/cuda/libggml-cuda.so /root/cuda/libggml-cuda.so.ggml-version $bin/
}

# dev_keep_module [DIR]: a module built here as xz parts of 15 MiB (a device
# call returns files up to a size) and its stamp under DIR (default
# $out/cuda), to be copied into .carry-cache/ so that tools/device/pack.sh
# carries it; nothing when the module came with the carry.
dev_keep_module() {
  local dir=${1:-$out/cuda}
  [ "$(cat /root/cuda/origin 2>/dev/null)" = restored ] && return 0
  mkdir -p "$dir"
  # parts of 15 MiB: a call returns at most 8 files of at most 16 MiB each,
  # and the module (about 39 MB xz) must come back whole beside the run's
  # own outputs (with 8 MiB parts its fifth part was cut off)
  xz -T0 -6 -c /root/cuda/libggml-cuda.so | split -b 15M - "$dir/libggml-cuda.so.xz.part-"
  cp /root/cuda/libggml-cuda.so.ggml-version "$dir/"
}

# dev_70b: the start of a run on the Llama-3-70B-shaped Q4_0 model (80
# layers, about 39 GB): machine.txt, the CUDA module fetched while the model
# is written; sets m to the model's path.
dev_70b() {
  dev_machine
  dev_module_start
  m=$(dev_synth llama3-70b)
  dev_module_wait
}

# dev_split_flags CONFIG: the strata flags of a configuration of the
# two-GPU profiling scripts: row (the row split), row-whole (the row split
# without halves), row-dq (the row split's halves each dequantizing the
# weights again, without the widened copy), one (one GPU).
dev_split_flags() {
  case $1 in
    row) echo "--devices 0,1 --split-mode row" ;;
    row-whole) echo "--devices 0,1 --split-mode row --row-halves 0" ;;
    row-dq) echo "--devices 0,1 --split-mode row --no-row-widen" ;;
    one) echo "--devices 0" ;;
    *) echo "unknown configuration $1 (row, row-whole, row-dq, one)" >&2; return 2 ;;
  esac
}

# dev_sanitizer: prints the path of compute-sanitizer (nothing if missing).
dev_sanitizer() {
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null
}

# The Qwen3-30B-A3B shape in the Q4_K_M mix (routing skew SKEW, default 1)
# with the module loaded and no router counts beside it: sets $s (the
# file) and $common (the bench flags at 8G). The machine and clock are
# recorded.
dev_moe30b() {
  dev_machine >/dev/null
  dev_clock
  dev_module_start
  s=$(SKEW=${SKEW:-1} TYPE=q4_k_m dev_synth qwen3-30b-a3b)
  echo "model: $s" > "$out/model.txt"
  dev_module_wait > "$out/module.txt" 2>&1
  rm -f "$s.experts.json"
  common="-m $s --device gpu --gpu-budget 8G -c 4096 -b 2048 -ub 2048"
}

# dev_moe30b, then a counting pass at 64 sequences so the expert split's
# GPU experts come from the router counts (stats.txt).
dev_moe30b_counted() {
  dev_moe30b
  timeout 120 $bin/strata bench $common -p 0 -n 0 -B 64 -r 1 --expert-stats 2>&1 | quiet > "$out/stats.txt"
}

# dev_rounds NAME ROUNDS ARGS: `strata bench $common ARGS FLAGS` under each
# set of the array `sets` ("ENV ...|FLAGS"), ROUNDS rounds interleaved, into
# $out/NAME_R_N.txt; the function `dev_before`, where defined, runs before
# each load (to reset the router counts beside the model).
dev_rounds() {
  local name=$1 rounds=$2 args=$3 r i set envs flags c
  for r in $(seq 1 "$rounds"); do
    i=0
    for set in "${sets[@]}"; do
      envs=${set%%|*}; flags=${set#*|}
      # a set's own -ub replaces common's (the CLI takes a flag once)
      c=$common; [[ " $flags " == *" -ub "* ]] && c=${common/ -ub 2048/}
      if declare -F dev_before >/dev/null; then dev_before; fi
      dev_mark "round $r, set $i: $set"
      # shellcheck disable=SC2086 # envs, args and flags: split on spaces
      { echo "== round $r: $envs strata bench $c $args $flags"
        env STRATA_LOG=strata=info $envs timeout 150 $bin/strata bench $c $args $flags 2>&1 | quiet; } \
        > "$out/${name}_${r}_$i.txt"
      i=$((i + 1))
    done
  done
}
