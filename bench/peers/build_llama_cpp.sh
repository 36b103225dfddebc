#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-batched-bench (Release, native CPU,
# no CUDA, no curl) from the llama.cpp source that the llama-cpp-python sdist on PyPI
# vendors, into a cache folder; keep the vendored convert_hf_to_gguf.py (with its
# conversion/ package) and gguf-py there.
#
#   bash bench/peers/build_llama_cpp.sh [DIR]
#
# DIR: $1, else $LLAMA_CPP_DIR, else ~/.cache/jengine/llama.cpp. Idempotent: the build is
# skipped when the three binaries are already there. Needs pip (the repository's .venv if
# there is one, else $PYTHON or python3), cmake, a C++ compiler and ninja or make.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # the llama-cpp-python sdist to take it from
DIR="${1:-${LLAMA_CPP_DIR:-$HOME/.cache/jengine/llama.cpp}}"
JOBS="${JOBS:-2}"
BINARIES=(llama-server llama-bench llama-batched-bench)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
BIN="$DIR/bin"

have_all() {
    local b
    for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
    [[ -f "$DIR/convert_hf_to_gguf.py" && -d "$DIR/conversion" && -d "$DIR/gguf-py/gguf" ]]
}

if have_all; then
    echo "llama.cpp already built in $DIR" >&2
else
    # 1. The source: the llama-cpp-python sdist, unpacked once into $DIR/src.
    SRC="$DIR/src"
    if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
        tmp="$(mktemp -d "$DIR/.download.XXXXXX")"
        trap 'rm -rf "$tmp"' EXIT
        echo "downloading the llama-cpp-python==$VERSION sdist" >&2
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$VERSION" -d "$tmp"
        shopt -s nullglob
        sdists=("$tmp"/llama[_-]cpp[_-]python-*.tar.gz)
        [[ ${#sdists[@]} -eq 1 ]] || { echo "no sdist downloaded into $tmp" >&2; exit 1; }
        sdist="${sdists[0]}"
        tar -xzf "$sdist" -C "$tmp"
        vendors=("$tmp"/llama[_-]cpp[_-]python-*/vendor/llama.cpp)
        shopt -u nullglob
        vendored="${vendors[0]:-}"
        [[ -f "$vendored/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in $sdist" >&2; exit 1; }
        # The sdist keeps the llama.cpp submodule's git HEAD: the vendored commit.
        commit="$(cat "$(dirname "$(dirname "$vendored")")"/.git/modules/vendor/llama.cpp/HEAD 2>/dev/null || true)"
        rm -rf "$SRC"
        mv "$vendored" "$SRC"
        if [[ "$commit" =~ ^[0-9a-f]{40}$ ]]; then
            echo "llama-cpp-python==$VERSION, llama.cpp $commit" > "$DIR/SOURCE"
        else
            echo "llama-cpp-python==$VERSION" > "$DIR/SOURCE"
        fi
        rm -rf "$tmp"
        trap - EXIT
    fi

    # 2. The build: only the three tools (and what they link), Release, native CPU.
    generator=()
    if command -v ninja >/dev/null; then generator=(-G Ninja); fi
    cmake -S "$SRC" -B "$DIR/build" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF \
        -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON \
        -DBUILD_SHARED_LIBS=OFF
    cmake --build "$DIR/build" --config Release -j "$JOBS" --target "${BINARIES[@]}"

    # 3. Install: the binaries; the converter with its `conversion` package and the gguf-py
    #    it is written against (it puts the gguf-py beside it first on sys.path).
    mkdir -p "$BIN"
    for b in "${BINARIES[@]}"; do
        install -m 755 "$DIR/build/bin/$b" "$BIN/$b"
    done
    install -m 755 "$SRC/convert_hf_to_gguf.py" "$DIR/convert_hf_to_gguf.py"
    rm -rf "$DIR/conversion" "$DIR/gguf-py"
    cp -r "$SRC/conversion" "$DIR/conversion"
    cp -r "$SRC/gguf-py" "$DIR/gguf-py"
fi

"$BIN/llama-server" --version 2>&1 | grep -i version >&2 || true
for b in "${BINARIES[@]}"; do echo "$BIN/$b"; done
echo "$DIR/convert_hf_to_gguf.py"
