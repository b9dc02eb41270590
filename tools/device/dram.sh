#!/usr/bin/env bash
# On the GPU machine: the DRAM tier. Correctness of a small synthetic model
# streamed through a DRAM window on CUDA, then the 70B-shaped model at a 12 GB
# GPU budget and an 18 GB DRAM budget (about half the model), beside O_DIRECT
# sequential reads of the same file in the same run, right before the bench:
# dd, Debian's fio (carried in .carry/fio by tools/device/fetch-fio.sh and
# tools/device/pack.sh; fio and apt are not on the machine) at the DRAM
# window's queue depth and read size, and tools/bench/fio-compare.sh (fio
# against the storage reader, .carry/bin/readbench, each reading the whole
# file).
#   tools/device/fetch-fio.sh; tools/device/pack.sh VOCAB.gguf   (here), then on the device:
#   bash tools/device/dram.sh
#
# The window's reads (src/engine/window.rs, DramWindow::new): one Reader with
# 2 io_uring workers and 16 reads in flight in all (8 per ring,
# src/storage/uring.rs), each read at most ReaderConfig::default().chunk_size
# = 1 MiB (src/storage/config.rs); a window per group kind (two readers).
# WIN_QD, WIN_WORKERS, WIN_CHUNK override; COMPARE_ROUNDS (default 1; 0
# skips) sets fio-compare.sh's rounds, each of which reads the whole ~38 GB
# file twice. Results under $OUT.
#
#   bash tools/device/dram.sh llama   # the SSD tier beside llama.cpp instead:
# both engines decode the 70B-shaped model with ${CAP_G:-24} GiB of host
# memory between them and the page cache (the rest of the machine's memory
# held by a resident filler process, the page cache dropped first), strata
# at --gpu-budget 12G --dram-budget 18G, llama.cpp at ngl=${LLAMA_NGL:-20}
# with its defaults (mmap: the weights it does not offload are read from
# the file through the page cache). Its --no-mmap cannot run there: it
# copies the whole file into host memory.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/lib.sh
if [ "${1:-}" = llama ]; then
  dev_70b || exit 1
  cap=$(( ${CAP_G:-24} * 1024 * 1024 ))   # KiB
  {
    echo "== host memory for both engines: ${CAP_G:-24} GiB (process and page cache)"
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" \
      || echo "(page cache could not be dropped: the filler evicts it)"
    swapon --show 2>/dev/null | grep -q . && echo "WARNING: swap is on; the filler may be swapped out"
    avail=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
    fill=$(( avail - cap ))
    echo "MemAvailable $((avail / 1048576)) GiB; filler $((fill / 1048576)) GiB"
    rm -f /root/filler.ok
    python3 -c "import sys,time; b=bytearray(b'\x01')*(int(sys.argv[1])*1024); open('/root/filler.ok','w').close(); time.sleep(3600)" $fill &
    filler=$!
    while [ ! -f /root/filler.ok ] && kill -0 $filler 2>/dev/null; do sleep 1; done
    [ -f /root/filler.ok ] && echo "filler resident" || echo "filler died"
    free -g | head -2
    t="-b 64 -c 1536 -p 64 -n 4 -B 0 -r 1"
    $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --dram-budget 18G $t 2>&1 | quiet
    free -g | head -2
    timeout "${LLAMA_S:-330}" $bin/strata bench -m "$m" --device gpu $t --no-strata --llama-ngl "${LLAMA_NGL:-20}" 2>&1 | quiet
    [ "${PIPESTATUS[0]}" = 124 ] && echo "llama.cpp did not finish within ${LLAMA_S:-330} s"
    free -g | head -2
    kill $filler; wait $filler 2>/dev/null
  } 2>&1 | tee "$out/bench_ssd_llama.txt"
  exit 0
fi
dev_machine
dev_module_start
s8=$(dev_synth llama3-8b 8)
dev_module_wait || exit 1
{
  echo "== llama3-8b (8 layers), every group streamed, DRAM window of 600M"
  $bin/strata check -m $s8 --device gpu --with-cpu -n 16 -c 512 --stream-all --dram-budget 600M 2>&1 | quiet
} | tee "$out/check_dram.txt"
m=$(dev_synth llama3-70b)
WIN_QD=${WIN_QD:-16}; WIN_WORKERS=${WIN_WORKERS:-2}; WIN_CHUNK=${WIN_CHUNK:-1M}
COMPARE_ROUNDS=${COMPARE_ROUNDS:-1}
FIO=.carry/fio/run-fio; FIO_ENGINE=io_uring
# fio_seq TITLE ARGS...: an O_DIRECT sequential read of the model at the
# window's chunk size; io_uring, or libaio where io_uring is refused.
fio_seq() {
  local title=$1 eng o rc; shift
  for eng in io_uring libaio; do
    o=$($FIO --name=seqread --filename="$m" --rw=read --direct=1 --ioengine=$eng \
      --bs="$WIN_CHUNK" --thread --group_reporting "$@" 2>&1); rc=$?
    [ $rc -eq 0 ] && { FIO_ENGINE=$eng; break; }
    echo "fio ($eng) failed, rc $rc: $(echo "$o" | grep -m2 -i -e error -e 'fio:' | paste -sd' ')"
  done
  echo "== fio $title ($eng, bs $WIN_CHUNK)"
  echo "$o" | grep -E 'READ:|err='
}
{
  echo "== O_DIRECT sequential read, dd bs=4M, 8 GiB"
  dd if="$m" of=/dev/null bs=4M iflag=direct count=2048 2>&1 | tail -1
  if [ -x $FIO ]; then
    half=$(( $(stat -c %s "$m") / 2 / 1048576 * 1048576 ))
    fio_seq "O_DIRECT sequential read, 1 job, iodepth $WIN_QD, 8 GiB" \
      --numjobs=1 --iodepth="$WIN_QD" --size=8G
    # one job per io_uring ring of one window, then of both windows (the
    # attention and FFN kinds each have a window and a Reader,
    # src/engine/store.rs, and both can have reads in flight at once)
    for j in "$WIN_WORKERS" $((2 * WIN_WORKERS)); do
      fio_seq "O_DIRECT sequential read, $j jobs (one per ring) x iodepth $((WIN_QD / WIN_WORKERS)), 8 GiB from $j places" \
        --numjobs="$j" --iodepth=$((WIN_QD / WIN_WORKERS)) --size=$((8192 / j))M \
        --offset_increment=$((2 * half / j))
    done
    # fio's buffers on hugetlb pages too (the reader's are transparent huge
    # pages; with 4 KiB pages a 1 MiB read can be split into more requests,
    # which made malloc'd fio buffers read at 0.5-1x the speed on a virtio
    # disk), where 64 can be had for a while; the old count is put back after.
    hp=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)
    [ "$hp" -ge 64 ] || echo 64 >/proc/sys/vm/nr_hugepages 2>/dev/null
    iomem=malloc
    if [ "$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)" -ge 64 ]; then
      iomem=shmhuge
      fio_seq "O_DIRECT sequential read, 1 job, iodepth $WIN_QD, 8 GiB, iomem=shmhuge" \
        --numjobs=1 --iodepth="$WIN_QD" --size=8G --iomem=shmhuge
    else
      echo "(no hugetlb pages: fio with iomem=shmhuge skipped)"
    fi
    if [ "$COMPARE_ROUNDS" -gt 0 ] && [ -x $bin/readbench ]; then
      echo "== tools/bench/fio-compare.sh: fio ($FIO_ENGINE, iomem=$iomem) vs the storage reader (readbench), whole file, qd $WIN_QD, chunk $WIN_CHUNK, $WIN_WORKERS workers"
      FIO=$FIO ENGINE=$FIO_ENGINE FIO_IOMEM=$iomem READBENCH=$bin/readbench QD=$WIN_QD \
        BS=$WIN_CHUNK WORKERS=$WIN_WORKERS ROUNDS=$COMPARE_ROUNDS \
        bash tools/bench/fio-compare.sh "$m" 2>&1 | tee "$out/fio_compare.txt"
    fi
    [ "$hp" -ge 64 ] || echo "$hp" >/proc/sys/vm/nr_hugepages 2>/dev/null
  else
    echo "(no $FIO: run tools/device/fetch-fio.sh before tools/device/pack.sh; fio skipped)"
  fi
  echo "== strata 12G GPU budget, 18G DRAM budget"
  $bin/strata bench -m "$m" --device gpu --gpu-budget 12G --dram-budget 18G -b 64 -c 1536 -p 64 -n 4 -B 8 --batch-steps 1 -r 1 2>&1 | quiet
} | tee "$out/bench_dram.txt"
