#!/usr/bin/env bash
# Installs the clients the server tests talk to strata serve with (the
# `openai` package, pinned in tests/serve/requirements.txt) into a venv at
# ~/.cache/strata/venv-serve. Safe to run repeatedly; prints the venv's python.
#   tools/serve-clients.sh            (STRATA_SERVE_VENV: another venv directory)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${STRATA_SERVE_VENV:-$HOME/.cache/strata/venv-serve}"
req=tests/serve/requirements.txt
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$venv/requirements.txt"; then
  python3 -m venv "$venv" 2>/dev/null || { python3 -m pip install --quiet --user virtualenv && python3 -m virtualenv -q "$venv"; }
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  cp "$req" "$venv/requirements.txt"
fi
echo "$venv/bin/python"
