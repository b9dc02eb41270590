#!/usr/bin/env bash
# Compares the SSD-tier reader with fio on the same file: O_DIRECT
# sequential reads at the same queue depth and chunk size, alternating
# ROUNDS times (each side first in turn); prints the best and median of
# each and reader/fio (target >= 0.90, issue 6).
#
#   tools/bench/fio-compare.sh FILE            # QD=8 BS=1M ROUNDS=3 WORKERS=1
#   QD=32 BS=4M tools/bench/fio-compare.sh FILE
#   FIO_IOMEM=shmhuge tools/bench/fio-compare.sh FILE   # fio on huge pages too
#
# Needs fio (apt-get install -y fio; FIO=path uses another one, e.g. the
# carried .carry/fio/run-fio from tools/device/fetch-fio.sh) and jq or python3 (to
# read fio's JSON). READBENCH=path uses a readbench binary built elsewhere
# instead of building examples/readbench.rs here.
set -euo pipefail
cd "$(dirname "$0")/../.."
FILE=${1:?usage: tools/bench/fio-compare.sh FILE}
QD=${QD:-8}
BS=${BS:-1M}
ROUNDS=${ROUNDS:-3}
WORKERS=${WORKERS:-1}
BACKEND=${BACKEND:-auto}
ENGINE=${ENGINE:-io_uring}
# fio's buffer memory. malloc (fio's default) is 4 KiB pages: on a device
# that takes few segments per request (virtio-blk: 254) a 1 MiB read is
# split, while the reader's buffers are huge pages. shmhuge makes it even;
# it needs hugetlb pages: echo 128 >/proc/sys/vm/nr_hugepages.
FIO_IOMEM=${FIO_IOMEM:-malloc}
# Extra readbench arguments, e.g. "--extent 4M --in-flight 2" for an 8 MiB
# destination footprint like fio's (the default cycles 128 MiB, as a pager
# window would; on this VM's virtio disk the footprint alone moves ~10%).
READER_ARGS=${READER_ARGS:-}

FIO=${FIO:-fio}
command -v "$FIO" >/dev/null || { echo "fio missing ($FIO): apt-get install -y fio, or FIO=path" >&2; exit 1; }
# fio's read bandwidth in GB/s from its JSON output on stdin.
if command -v jq >/dev/null; then
  fio_json_gbps() { jq -r '.jobs[0].read.bw_bytes / 1e9'; }
elif command -v python3 >/dev/null; then
  fio_json_gbps() {
    python3 -c 'import json, sys
s = sys.stdin.read()
print(json.loads(s[s.index("{"):])["jobs"][0]["read"]["bw_bytes"] / 1e9)'
  }
else
  echo "neither jq nor python3 found (to read fio's JSON)" >&2; exit 1
fi
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
  "$FIO" --name=seqread --filename="$FILE" --rw=read --direct=1 \
    --ioengine="$ENGINE" --iodepth="$QD" --bs="$BS" --numjobs=1 \
    --iomem="$FIO_IOMEM" --thread --output-format=json 2>/dev/null |
    fio_json_gbps
}

reader_gbps() {
  drop_caches
  "$READBENCH" "$FILE" --qd "$QD" --chunk "$BS" --workers "$WORKERS" \
    --backend "$BACKEND" $READER_ARGS | awk '/^pass/ {print > "/dev/stderr"} /^GBPS/ {print $2}'
}

fio_all=()
reader_all=()
for r in $(seq 1 "$ROUNDS"); do
  # Alternate who goes first: a disk with burst credits or a host cache
  # favours one side otherwise.
  if [ $((r % 2)) -eq 1 ]; then
    f=$(fio_gbps)
    g=$(reader_gbps)
  else
    g=$(reader_gbps)
    f=$(fio_gbps)
  fi
  printf 'round %d: fio %.3f GB/s, reader %.3f GB/s\n' "$r" "$f" "$g"
  fio_all+=("$f")
  reader_all+=("$g")
done

# best and median of a list of numbers
stats() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {
  m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
  printf "%.3f %.3f\n", v[NR], m }'; }
read -r fio_best fio_med < <(stats "${fio_all[@]}")
read -r rd_best rd_med < <(stats "${reader_all[@]}")

size=$(stat -c %s "$FILE")
echo "file: $FILE ($size bytes), O_DIRECT sequential read, qd $QD, chunk $BS, $ROUNDS rounds"
echo "fio    ($ENGINE, 1 job, iomem=$FIO_IOMEM): best $fio_best GB/s, median $fio_med GB/s"
echo "reader ($BACKEND, $WORKERS worker(s)): best $rd_best GB/s, median $rd_med GB/s"
awk -v gb="$rd_best" -v fb="$fio_best" -v gm="$rd_med" -v fm="$fio_med" 'BEGIN {
  rb = (fb > 0) ? gb / fb : 0
  rm = (fm > 0) ? gm / fm : 0
  printf "ratio reader/fio: best %.3f, median %.3f (target >= 0.90): %s\n", rb, rm,
    (rb >= 0.9 && rm >= 0.9) ? "ok" : "BELOW TARGET"
}'
