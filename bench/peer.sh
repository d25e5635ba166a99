#!/usr/bin/env bash
# Builds the peer: llama.cpp's own C++ `llama-server`, from the llama.cpp sources that ship inside
# llama-cpp-python's sdist (vendor/llama.cpp; pip fetches it, nothing else needs the internet).
# cmake + ninja, a few minutes on 2 cores. Not GGML_NATIVE: a native build died with SIGILL at start-up
# on AMX machines; the AVX-512, VNNI and AMX paths are enabled when this CPU has them. Reused when it runs.
# Usage: bench/peer.sh [DIR] [ISA]  ->  DIR/bin/llama-server
# ISA: native (default: what this CPU has) or avx2 (AVX2 + FMA only, the kernels an AMD Zen 3 runs;
# for the emulated AVX2 column of `make bench`, beside PREFIXSERVE_NATIVE_ISA=avx2).
set -euo pipefail
DIR="${1:-.peer}"
ISA="${2:-native}"
SPEC="${PEER_SPEC:-llama-cpp-python==0.3.36}"
BIN="$DIR/bin/llama-server"
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  exit 0
fi
command -v cmake >/dev/null && command -v ninja >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake ninja-build g++
}
mkdir -p "$DIR/src"
echo "building $BIN from $SPEC's sources; this compiles llama.cpp and takes a few minutes" >&2
python3 -m pip download -q --no-deps --no-binary :all: "$SPEC" -d "$DIR/src"
tar xzf "$DIR"/src/llama_cpp_python-*.tar.gz -C "$DIR/src"
SRC="$(ls -d "$DIR"/src/llama_cpp_python-*/vendor/llama.cpp)"
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if [ "$ISA" = native ]; then
  grep -qw avx512f /proc/cpuinfo && FLAGS="$FLAGS -DGGML_AVX512=ON"
  grep -qw avx512_bf16 /proc/cpuinfo && FLAGS="$FLAGS -DGGML_AVX512_BF16=ON"
  grep -qw avx512_vnni /proc/cpuinfo && FLAGS="$FLAGS -DGGML_AVX512_VNNI=ON"
elif [ "$ISA" != avx2 ]; then
  echo "bench/peer.sh: ISA must be native or avx2, not $ISA" >&2; exit 2
fi
# Not ggml's AMX kernels (GGML_AMX_TILE/INT8/BF16): built with them, this llama.cpp dies at its first
# prompt with SIGILL on a `tilezero` in libggml-cpu (Xeon with AMX, 2026-12-03: a tile instruction
# with no tile configuration loaded on that thread), so the peer runs its AVX-512 (VNNI) kernels there.
echo "llama.cpp build flags: $FLAGS" >&2
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release $FLAGS -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
ninja -C "$DIR/build" llama-server >/dev/null
ln -sfn build/bin "$DIR/bin"  # llama.cpp puts the binary and its shared libraries in build/bin
"$BIN" --version
