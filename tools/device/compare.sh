#!/usr/bin/env bash
# On the GPU machine: pp2048 and 64-sequence decode at 12G of the 70B-shaped
# Q4_0 model for HEAD and each older binary in .carry/old/*.xz (from
# tools/device/build-old.sh), interleaved over ROUNDS rounds, to find which
# commit changed a figure. The older binaries run beside HEAD's libraries
# and CUDA module (the same ggml of the same crate) without its version
# stamp: older builds compared the stamp with their own source archive's
# checksum. Binaries named N-COMMIT.xz run in that order.
#   tools/device/build-old.sh COMMIT...; XZ_BIN=1 tools/device/pack.sh VOCAB.gguf;
#   mkdir -p .carry/old; cp .carry-cache/old/COMMIT.xz .carry/old/   (here), then on the device:
#   ROUNDS=2 TESTS="-p 2048 -B 64" bash tools/device/compare.sh
# ROUNDS: rounds (default 2); TESTS: the bench tests (default "-p 2048 -B 64");
# HEADS: HEAD's variants, ';'-separated extra arguments (default: one plain
# HEAD), e.g. HEADS="--hybrid off;--hybrid off --ffn-rows 2048".
# STEP: the step flags (default "-b 2048 -ub 2048"; STEP= keeps bench's
# defaults, as tools/device/gemm.sh batch runs 64 sequences).
# Results in $OUT/compare.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
dev_70b || exit 1
TESTS=${TESTS:--p 2048 -B 64}
o=/root/old; mkdir -p $o
cp $bin/lib*.so* $o/; rm -f $o/*.ggml-version
IFS=';' read -ra heads <<< "${HEADS:-}"
[ ${#heads[@]} -gt 0 ] || heads=("")
names=()
for i in "${!heads[@]}"; do names+=("HEAD$i"); done
for x in .carry/old/*.xz; do
  [ -f "$x" ] || continue
  n=$(basename "$x" .xz); xz -dc "$x" > $o/strata-$n; chmod +x $o/strata-$n; names+=("$n")
done
{
  echo "== 12G $TESTS: ${names[*]}, interleaved"
  for i in "${!heads[@]}"; do echo "HEAD$i: HEAD ${heads[$i]}"; done
  for r in $(seq ${ROUNDS:-2}); do
    for n in "${names[@]}"; do
      extra=""
      case $n in
        HEAD*) s=$bin/strata; extra=${heads[${n#HEAD}]} ;;
        *) s=$o/strata-$n ;;
      esac
      # -b was the step before -ub existed
      ub=$($s bench --help | grep -q ubatch-size && echo "-ub 2048")
      echo "-- round $r: $n"
      $s bench -m "$m" --device gpu --gpu-budget 12G $TESTS ${STEP--b 2048 $ub} -n 0 -r 2 $extra 2>&1 | quiet \
        | grep -e "^plan:" -e "pp[0-9]" -e batched -e rror
    done
  done
} 2>&1 | tee "$out/compare.txt"
