#!/usr/bin/env bash
# llama.cpp (CPU only) built outside the repository from the sources vendored in the
# llama-cpp-python sdist, for tools/make_gguf.py (llama-quantize) and tools/bench_sizes.py
# (llama-bench, llama-server). Not run by tests; nothing of it is committed.
#
#   tools/build_llama_cpp.sh [SDIST] [SRC_DIR] [BUILD_DIR]
#
# Defaults: SDIST /tmp/x/llama_cpp_python-0.3.36.tar.gz (fetched with
# `pip download --no-deps -d /tmp/x llama-cpp-python==0.3.36` when missing), SRC_DIR
# /work/llamacpp-src, BUILD_DIR /work/llamacpp-build. The steps, as run for issue 37:
#
#   pip download --no-deps -d /tmp/x llama-cpp-python==0.3.36
#   mkdir -p /work/llamacpp-src && tar xzf /tmp/x/llama_cpp_python-0.3.36.tar.gz -C /work/llamacpp-src --strip-components=1
#   cd /work/llamacpp-src
#   cmake -B /work/llamacpp-build vendor/llama.cpp -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
#         -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF
#   cmake --build /work/llamacpp-build --config Release -j2 --target llama-quantize llama-bench llama-server
#
# The binaries land in BUILD_DIR/bin. The build takes 10-20 minutes on 2 cores; run it with
# nohup in the background where a shell cuts long commands:
#   nohup tools/build_llama_cpp.sh > /work/llamacpp-build.log 2>&1 &
# GGML_NATIVE=ON builds for this CPU only (-march=native): rebuild on another machine.
set -euo pipefail

SDIST=${1:-/tmp/x/llama_cpp_python-0.3.36.tar.gz}
SRC=${2:-/work/llamacpp-src}
BUILD=${3:-/work/llamacpp-build}
JOBS=${JOBS:-2}

if [ ! -f "$SDIST" ]; then
    python3 -m pip download --no-deps -d "$(dirname "$SDIST")" llama-cpp-python==0.3.36
fi
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    mkdir -p "$SRC"
    tar xzf "$SDIST" -C "$SRC" --strip-components=1
fi
cd "$SRC"
cmake -B "$BUILD" vendor/llama.cpp -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_BUILD_TESTS=OFF
cmake --build "$BUILD" --config Release -j"$JOBS" --target llama-quantize llama-bench llama-server
ls -la "$BUILD/bin"
