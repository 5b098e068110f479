#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` as an anchor of bench/throughput.py, outside the repository.
#
#   bench/llamacpp_setup.sh [DIR]       # default: ~/.cache/pagedserve/llama.cpp (beside vLLM's venv)
#
# llama.cpp ships no Linux binary on the registries this project reaches, but the sdist of
# llama-cpp-python carries llama.cpp's source under vendor/llama.cpp; only the C++ is built from it
# (not the Python binding). Steps, each skipped when already done:
#   1. `pip download --no-deps --no-binary :all: llama-cpp-python==$VERSION` into DIR/src;
#   2. unpack it; DIR/src/VERSION records which llama.cpp that is;
#   3. cmake with native CPU flags (AVX-512 where the CPU has it; GGML_CPU_FLAGS replaces them: the AVX2 build
#      below), no curl/OpenSSL, the server only;
#      `cmake --build --target llama-server` (about 10 minutes on 2 cores);
#   4. DIR/bin/llama-server, the binary bench/llamacpp_anchor.py looks for.
# It serves the same GGUF as pagedserve's default model, so no conversion step is needed.
#
# llama-server with AVX2 alone beside the native one, for the bench on an AVX-512 CPU held to AVX2 (make test-avx2's
# settings; docs/performance.md, thirty-sixth session):
#   GGML_CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
#     bench/llamacpp_setup.sh ~/.cache/pagedserve/llama.cpp-avx2
set -euo pipefail
DIR="${1:-${PAGEDSERVE_LLAMACPP_DIR:-$HOME/.cache/pagedserve/llama.cpp}}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
SERVER="$DIR/bin/llama-server"

if [ -x "$SERVER" ] && "$SERVER" --version >/dev/null 2>&1; then
    echo "llamacpp_setup: ready ($SERVER, $(cat "$DIR/src/VERSION" 2>/dev/null || echo 'version unknown'))"
    exit 0
fi
command -v cmake >/dev/null && command -v c++ >/dev/null || {
    echo "llamacpp_setup: needs cmake and a C++ compiler (Debian: apt-get install cmake g++)" >&2
    exit 1
}
mkdir -p "$DIR/src" "$DIR/bin"
SDIST="$(ls "$DIR"/src/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$SDIST" ]; then
    echo "llamacpp_setup: downloading the llama-cpp-python $VERSION sdist (llama.cpp's source)"
    python3 -m pip download --quiet --no-deps --no-binary :all: -d "$DIR/src" "llama-cpp-python==$VERSION"
    SDIST="$(ls "$DIR"/src/llama_cpp_python-"$VERSION".tar.gz)"
fi
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tar -xzf "$SDIST" -C "$DIR/src"
fi
# the sdist has no .git; the version is the binding's, and the server's --version gives the build
echo "llama-cpp-python $VERSION (vendored llama.cpp)" > "$DIR/src/VERSION"

echo "llamacpp_setup: building llama-server with $JOBS jobs (about 10 minutes on 2 cores)"
start=$(date +%s)
# shellcheck disable=SC2086  # the flags are words
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF ${GGML_CPU_FLAGS:--DGGML_NATIVE=ON} \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF >"$DIR/cmake-configure.log" 2>&1 \
    || { tail -30 "$DIR/cmake-configure.log" >&2; exit 1; }
cmake --build "$DIR/build" --target llama-server -j"$JOBS" >"$DIR/cmake-build.log" 2>&1 \
    || { tail -30 "$DIR/cmake-build.log" >&2; exit 1; }
echo "llamacpp_setup: built in $(( $(date +%s) - start )) s"
# shared libraries (libllama, libggml*) sit beside the binary in build/bin; link rather than copy
# so a rebuild is picked up
ln -sf "$DIR/build/bin/llama-server" "$SERVER"
"$SERVER" --version 2>&1 | sed 's/^/llamacpp_setup: /'
echo "llamacpp_setup: ready ($SERVER)"
