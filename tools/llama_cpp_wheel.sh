#!/usr/bin/env bash
# Install llama-cpp-python, the reference implementation the tests compare against.
#
# It builds from source (minutes), so the wheel is built once and cached - in a
# folder named after the CPU features it was built for. A wheel built on an
# AVX-512 machine dies with "Illegal instruction" on an AVX2-only one, and pip's
# own wheel cache ignores CMAKE_ARGS, so: the flags are derived from this CPU,
# pip builds with --no-cache-dir, and the install only looks in this CPU's folder.
# GGML_NATIVE=OFF: the default -march=native build segfaulted on quantized models
# on a machine with AMX (FACTS.md), so the ISA flags are set one by one instead.
set -euo pipefail
py=$1
wheels=$2
version=0.3.36

flags=(-DGGML_NATIVE=OFF)
case "$(uname -m)" in
x86_64)
    have() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }
    key=x86_64
    # cpuinfo flag -> ggml option; a feature counts only where the CPU reports it
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
        avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        if have "${pair%%:*}"; then
            flags+=("-DGGML_${pair#*:}=ON")
            key+="-${pair%%:*}"
        else
            flags+=("-DGGML_${pair#*:}=OFF")
        fi
    done
    ;;
aarch64)
    # the Pi 5's Cortex-A76 baseline: ARMv8.2-A with dot product and fp16
    flags+=(-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16)
    key=aarch64-armv8.2-dotprod-fp16
    ;;
*)
    key=$(uname -m)
    ;;
esac

dir="$wheels/$key"
if ! compgen -G "$dir/llama_cpp_python-$version-*.whl" >/dev/null; then
    mkdir -p "$dir"
    echo "building llama-cpp-python $version for $key once (several minutes); cached in $dir"
    tmp=$(mktemp -d "$dir/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    CMAKE_ARGS="${flags[*]}" "$py" -m pip wheel -q --no-cache-dir --no-deps "llama-cpp-python==$version" -w "$tmp"
    mv "$tmp"/llama_cpp_python-*.whl "$dir/"  # only a finished wheel ever lands in the cache
fi
"$py" -m pip install -q --find-links "$dir" "llama-cpp-python==$version"  # with its dependencies
# then this CPU's wheel and nothing else, even over a build for another CPU in the .venv
"$py" -m pip install -q --force-reinstall --no-deps --no-index --find-links "$dir" "llama-cpp-python==$version"
