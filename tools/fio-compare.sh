#!/usr/bin/env bash
# Compares the SSD-tier reader with fio on the same file: O_DIRECT
# sequential reads at the same queue depth and chunk size, alternating
# ROUNDS times, best of each. Prints both figures and reader/fio (target
# >= 0.90, issue 6).
#
#   tools/fio-compare.sh FILE            # QD=8 BS=1M ROUNDS=3 WORKERS=1
#   QD=32 BS=4M tools/fio-compare.sh FILE
#
# Needs fio (apt-get install -y fio) and jq. READBENCH=path uses a readbench
# binary built elsewhere instead of building examples/readbench.rs here.
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=${1:?usage: tools/fio-compare.sh FILE}
QD=${QD:-8}
BS=${BS:-1M}
ROUNDS=${ROUNDS:-3}
WORKERS=${WORKERS:-1}
BACKEND=${BACKEND:-auto}
ENGINE=${ENGINE:-io_uring}

command -v fio >/dev/null || { echo "fio missing: apt-get install -y fio" >&2; exit 1; }
command -v jq >/dev/null || { echo "jq missing: apt-get install -y jq" >&2; exit 1; }
[ -r "$FILE" ] || { echo "cannot read $FILE" >&2; exit 1; }

if [ -z "${READBENCH:-}" ]; then
  cargo build --release --example readbench >&2
  READBENCH=target/release/examples/readbench
fi

drop_caches() {
  # O_DIRECT bypasses the page cache anyway; dropping it only needs root.
  sync
  echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
}

fio_gbps() {
  drop_caches
  fio --name=seqread --filename="$FILE" --rw=read --direct=1 \
    --ioengine="$ENGINE" --iodepth="$QD" --bs="$BS" --numjobs=1 \
    --thread --output-format=json 2>/dev/null |
    jq -r '.jobs[0].read.bw_bytes / 1e9'
}

reader_gbps() {
  drop_caches
  "$READBENCH" "$FILE" --qd "$QD" --chunk "$BS" --workers "$WORKERS" \
    --backend "$BACKEND" | awk '/^pass/ {print > "/dev/stderr"} /^GBPS/ {print $2}'
}

best_fio=0
best_reader=0
max() { awk -v a="$1" -v b="$2" 'BEGIN {print (a > b) ? a : b}'; }
for r in $(seq 1 "$ROUNDS"); do
  f=$(fio_gbps)
  g=$(reader_gbps)
  printf 'round %d: fio %.3f GB/s, reader %.3f GB/s\n' "$r" "$f" "$g"
  best_fio=$(max "$best_fio" "$f")
  best_reader=$(max "$best_reader" "$g")
done

size=$(stat -c %s "$FILE")
echo "file: $FILE ($size bytes), O_DIRECT sequential read, qd $QD, chunk $BS, best of $ROUNDS"
printf 'fio    (%s, 1 job):       %.3f GB/s\n' "$ENGINE" "$best_fio"
printf 'reader (%s, %s worker(s)): %.3f GB/s\n' "$BACKEND" "$WORKERS" "$best_reader"
awk -v g="$best_reader" -v f="$best_fio" 'BEGIN {
  r = (f > 0) ? g / f : 0
  printf "ratio reader/fio: %.3f (target >= 0.90): %s\n", r, (r >= 0.9) ? "ok" : "BELOW TARGET"
}'
