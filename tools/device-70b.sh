# Sourced by the device scripts: the binaries, the CUDA module (restored
# from .carry/cuda or built once per machine) and the 70B-shaped Q4_0 model
# written by strata-convert synth (both kept under /root while the machine
# stays warm). Sets out, bin, v, m and the log filter f.
out=${OUT:-device-out}; mkdir -p "$out"
source tools/device-bin.sh; v=.carry/models/vocab-smollm2.gguf
mkdir -p /root/m /root/cuda
# the vocabulary model may travel xz-compressed (with a CUDA module in
# .carry/cuda the carry is close to its 64 MiB)
[ -f $v ] || { xz -dc $v.xz > /root/m/vocab.gguf && v=/root/m/vocab.gguf; }
f() { grep -v -e "^load_backend" -e "^ggml_cuda_init" -e "^  Device 0"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|Flags" | cut -c1-200 >> "$out/machine.txt"
# the CUDA module: built once per machine (4 minutes), while the model is written
if [ ! -f /root/cuda/libggml-cuda.so ]; then
  { bash tools/device-restore-module.sh && cp $bin/libggml-cuda.so* /root/cuda/; } > "$out/module.txt" 2>&1 &
fi
m=/root/m/llama3-70b-q4_0.gguf
[ -f "$m" ] || $bin/strata-convert synth --preset llama3-70b --type q4_0 --vocab-from $v "$m" 2>&1 | tail -1 > "$out/synth.txt"
# the written file's dirty pages are flushed before anything is timed (run
# 14: the CPU read 64.5 GB/s during the writeback, 90 a minute later)
sync
wait
cp /root/cuda/libggml-cuda.so* $bin/
