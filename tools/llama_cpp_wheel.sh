#!/usr/bin/env bash
# Install llama-cpp-python, the reference implementation the tests compare against.
#
#   tools/llama_cpp_wheel.sh PYTHON WHEELS               # built for this CPU, into PYTHON's env
#   tools/llama_cpp_wheel.sh PYTHON WHEELS ISA DIR       # built for ISA (as EDGETP_ISA names them),
#                                                        # installed into folder DIR (for PYTHONPATH)
#
# It builds from source (minutes), so a wheel is built once and cached - in a
# folder named after the CPU features it was built for. A wheel built on an
# AVX-512 machine dies with "Illegal instruction" on an AVX2-only one, and pip's
# own wheel cache ignores CMAKE_ARGS, so: the flags are derived from this CPU (or
# the ISA asked for), pip builds with --no-cache-dir, and the install only looks
# in that folder. GGML_NATIVE=OFF: the default -march=native build segfaulted on
# quantized models on a machine with AMX (FACTS.md), so ISA flags are set one by one.
# tools/bench_local.py uses the ISA form to stand llama.cpp beside each edgetp ISA.
set -euo pipefail
py=$1
wheels=$2
isa=${3:-native}
target=${4:-}
version=0.3.36

flags=(-DGGML_NATIVE=OFF)
# cpuinfo flag -> ggml option, for the x86 ISA levels
x86=(avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI
     avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16)
case "$isa" in
native) want="" ;;
generic) want=" " ;;
avx2) want=" avx avx2 fma f16c bmi2 " ;;
avxvnni) want=" avx avx2 fma f16c bmi2 avx_vnni " ;;
avx512vnni) want=" avx avx2 fma f16c bmi2 avx512f avx512_vnni " ;;
neon) want="" ;;
*) echo "llama_cpp_wheel.sh: unknown ISA '$isa' (native, generic, avx2, avxvnni, avx512vnni, neon)" >&2; exit 2 ;;
esac

case "$(uname -m)" in
x86_64)
    [ "$isa" != neon ] || { echo "llama_cpp_wheel.sh: neon is an aarch64 ISA" >&2; exit 2; }
    have() {
        if [ -n "$want" ]; then [[ "$want" == *" $1 "* ]]; else grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; fi
    }
    key=x86_64
    for pair in "${x86[@]}"; do
        if have "${pair%%:*}"; then
            flags+=("-DGGML_${pair#*:}=ON")
            key+="-${pair%%:*}"
        else
            flags+=("-DGGML_${pair#*:}=OFF")
        fi
    done
    ;;
aarch64)
    case "$isa" in
    generic) flags+=(-DGGML_CPU_ARM_ARCH=armv8-a); key=aarch64-armv8 ;;
    native | neon)  # the Pi 5's Cortex-A76 baseline: ARMv8.2-A with dot product and fp16
        flags+=(-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16); key=aarch64-armv8.2-dotprod-fp16 ;;
    *) echo "llama_cpp_wheel.sh: $isa is an x86 ISA" >&2; exit 2 ;;
    esac
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
if [ -n "$target" ]; then
    # a folder of its own: the dependencies come from the environment that puts it on PYTHONPATH
    if [ ! -f "$target/.$key" ]; then
        rm -rf "$target"
        "$py" -m pip install -q --no-deps --no-index --target "$target" "$dir"/llama_cpp_python-$version-*.whl
        touch "$target/.$key"
    fi
    exit 0
fi
"$py" -m pip install -q --find-links "$dir" "llama-cpp-python==$version"  # with its dependencies
# then this CPU's wheel and nothing else, even over a build for another CPU in the .venv
"$py" -m pip install -q --force-reinstall --no-deps --no-index --find-links "$dir" "llama-cpp-python==$version"
