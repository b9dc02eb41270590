#!/usr/bin/env bash
# Installs what building strata needs on a fresh Debian/Ubuntu machine:
# a C/C++ toolchain, cmake, libclang (bindgen), python3 + pip (test models)
# and a Rust toolchain. Safe to run repeatedly.
set -euo pipefail
need=()
command -v cc >/dev/null || need+=(build-essential)
command -v cmake >/dev/null || need+=(cmake)
command -v git >/dev/null || need+=(git)
command -v curl >/dev/null || need+=(curl ca-certificates)
command -v python3 >/dev/null || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# bindgen loads libclang (the C API) at build time; libclang-cpp, which
# llvm-*-dev installs, is another library: detect what bindgen would load.
"$(dirname "${BASH_SOURCE[0]}")/find-libclang.sh" >/dev/null || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
  [ -x "$HOME/.cargo/bin/cargo" ] || curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >&2
  export PATH="$HOME/.cargo/bin:$PATH"
fi
