#!/usr/bin/env bash
# Creates the peer's venv (llama-cpp-python's OpenAI server, which compiles llama.cpp for this
# CPU: a few minutes on 2 cores). Reused when it already imports. Usage: bench/peer.sh [VENV]
set -euo pipefail
VENV="${1:-.venv-peer}"
SPEC="${PEER_SPEC:-llama-cpp-python[server]==0.3.36}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp.server.app" 2>/dev/null; then
  exit 0
fi
echo "building $VENV ($SPEC); this compiles llama.cpp and takes a few minutes" >&2
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$VENV/bin/python" -m pip install -q "$SPEC"
"$VENV/bin/python" -c "import llama_cpp.server.app"
