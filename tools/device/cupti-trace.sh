# Sourced by device scripts: cupti_build builds tools/device/cupti-trace.c
# against the machine's CUDA toolkit (its CUPTI headers and library) into
# /root/cupti-trace.so, with the newest kernel and copy record versions
# its headers declare (what that CUPTI writes); prints why where it cannot.
# Then run a command under it:
#   CUDA_INJECTION64_PATH=/root/cupti-trace.so CUPTI_TRACE_OUT=FILE.tsv CMD
# and sum a step with python3 tools/device/kernel-sum.py FILE.tsv.
cupti_build() {
  local cuda inc lib v k m p
  cuda=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
  for d in "$cuda/extras/CUPTI/include" "$cuda/include" "$cuda/targets/x86_64-linux/include"; do
    [ -f "$d/cupti.h" ] && { inc=$d; break; }
  done
  for d in "$cuda/extras/CUPTI/lib64" "$cuda/lib64" "$cuda/targets/x86_64-linux/lib"; do
    ls "$d"/libcupti.so* >/dev/null 2>&1 && { lib=$d; break; }
  done
  [ -n "${inc:-}" ] && [ -n "${lib:-}" ] || { echo "cupti: no CUPTI under $cuda (headers: ${inc:-none}, library: ${lib:-none})"; return 1; }
  pick() { # the newest version N of record $1 the headers declare (typedef ... } NAME N;)
    for v in 14 13 12 11 10 9 8 7 6 5 4 3 2; do
      grep -qs "} $1$v;" "$inc"/cupti_activity*.h && { echo "$1$v"; return; }
    done
  }
  k=$(pick CUpti_ActivityKernel); m=$(pick CUpti_ActivityMemcpy); p=$(pick CUpti_ActivityMemcpyPtoP)
  gcc -O2 -shared -fPIC -o /root/cupti-trace.so tools/device/cupti-trace.c -I"$inc" -I"$cuda/include" \
    -DKERNEL_T="$k" -DMEMCPY_T="$m" -DPTOP_T="$p" -L"$lib" -lcupti -Wl,-rpath,"$lib" \
    || { echo "cupti: build failed ($k, $m, $p)"; return 1; }
  echo "cupti: /root/cupti-trace.so ($k, $m, $p; $lib)"
}
