#!/usr/bin/env bash
# Install llama-cpp-python, the reference implementation the tests compare against.
# It builds from source (minutes), so the wheel is built once into a cache folder
# and later runs install from there. GGML_NATIVE=OFF: the default -march=native
# build segfaults on quantized models on these VMs (AMX), see FACTS.md.
set -euo pipefail
py=$1
wheels=$2
version=0.3.36
if ! compgen -G "$wheels/llama_cpp_python-$version-*.whl" >/dev/null; then
    mkdir -p "$wheels"
    echo "building llama-cpp-python $version once (several minutes); cached in $wheels"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON" \
        "$py" -m pip wheel -q --no-deps "llama-cpp-python==$version" -w "$wheels"
fi
"$py" -m pip install -q --find-links "$wheels" "llama-cpp-python==$version"
