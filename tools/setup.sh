#!/usr/bin/env bash
# Installs what building and testing strata needs on a fresh Debian/Ubuntu
# machine, and nothing else: a C/C++ toolchain and cmake (ffi/build.rs builds
# the vendored ggml and llama.cpp; the bindings are committed, so no
# libclang), xz and patch (the vendored archive and its patches), curl
# (rustup; vendor/verify.sh), and python3 with pip and venv (test models from PyPI, the server tests'
# clients), then a Rust toolchain if there is none. Safe to run repeatedly;
# tools/demo.sh and tools/test.sh source it.
#   tools/setup.sh            install what is missing (or: source tools/setup.sh)
#   tools/setup.sh --check    print the missing Debian packages, install nothing
set -euo pipefail

# The Debian packages missing here, one per line, each detected by what the
# build runs: the commands on PATH, python's modules.
strata_missing_packages() {
  local have_py=0
  { command -v cc && command -v c++ && command -v make; } >/dev/null || echo build-essential
  command -v cmake >/dev/null || echo cmake
  command -v xz >/dev/null || echo xz-utils
  command -v patch >/dev/null || echo patch
  command -v curl >/dev/null || echo curl
  [ -e /etc/ssl/certs/ca-certificates.crt ] || echo ca-certificates
  command -v python3 >/dev/null && have_py=1
  [ $have_py = 1 ] || echo python3
  { [ $have_py = 1 ] && python3 -m pip --version; } >/dev/null 2>&1 || echo python3-pip
  { [ $have_py = 1 ] && python3 -c 'import venv, ensurepip'; } >/dev/null 2>&1 || echo python3-venv
}

if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = "--check" ]; then
  strata_missing_packages
  exit 0
fi

mapfile -t need < <(strata_missing_packages)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
  [ -x "$HOME/.cargo/bin/cargo" ] || curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >&2
  export PATH="$HOME/.cargo/bin:$PATH"
fi
