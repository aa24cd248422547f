#!/usr/bin/env bash
# The programs `simmer bench cpu-cost` runs under qemu, built into OUT (default ~/.cache/simmer-cpu-cost):
#
#   bench/cpu_cost/build.sh plugin          OUT/libinsn_count.so: the instruction counter (insn_count.c), for
#                                           the host's qemu-user (a host library whatever the guest)
#   bench/cpu_cost/build.sh llama CLASS     OUT/llama_count-CLASS: llama.cpp's guest (llama_count.cpp) from
#                                           llama-cpp-python 0.3.36's sdist (vendor/llama.cpp), the version
#                                           simmer's benchmarks compare with, built for CLASS:
#       avx2        x86-64, GGML_NATIVE=OFF, AVX2 + FMA + F16C + BMI2, no AVX-512 (what -cpu Haswell runs)
#       native      x86-64, GGML_NATIVE=ON: this machine's own best (AVX-512 VNNI here), timed, never counted
#       sse42       x86-64, SSE 4.2 only (no AVX): for the calibration alone (docs/cpu-classes.md), one program
#                   both counted under -cpu Haswell and timed natively, as avx2 is
#       cortex-a76  aarch64, -mcpu=cortex-a76 (dot product), Debian's gcc-aarch64-linux-gnu cross compilers
#       cortex-a72  aarch64, -mcpu=cortex-a72 (no dot product)
# The llama.cpp programs are linked statically: under qemu-user they need no guest libraries.
# One thread of the machine builds each, nice -n 10; what is built already is kept (delete OUT to rebuild).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${SIMMER_CPU_COST_BUILD:-$HOME/.cache/simmer-cpu-cost}"
mkdir -p "$out"
what="${1:?usage: build.sh plugin | llama avx2|native|sse42|cortex-a76|cortex-a72}"

if [ "$what" = plugin ]; then
    [ -f "$out/libinsn_count.so" ] && [ "$out/libinsn_count.so" -nt "$here/insn_count.c" ] && { echo "$out/libinsn_count.so"; exit 0; }
    gcc -O2 -shared -fPIC -fvisibility=hidden -Wall -Wextra -o "$out/libinsn_count.so" "$here/insn_count.c"
    echo "$out/libinsn_count.so"
    exit 0
fi
[ "$what" = llama ] || { echo "unknown: $what" >&2; exit 2; }
class="${2:?usage: build.sh llama avx2|native|sse42|cortex-a76|cortex-a72}"
binary="$out/llama_count-$class"
[ -x "$binary" ] && [ "$binary" -nt "$here/llama_count.cpp" ] && { echo "$binary"; exit 0; }

# the sdist: pip's download (its cache makes a second one free), or the test suite's copy
sdist="$(ls "$HOME"/.cache/simmer-test/sdists/llama_cpp_python-0.3.36.tar.gz "$out"/llama_cpp_python-0.3.36.tar.gz 2>/dev/null | head -n 1 || true)"
if [ -z "$sdist" ]; then
    pip="${PIP:-$(dirname "$(command -v python3)")/pip3}"
    "$pip" download --no-binary :all: --no-deps -d "$out" llama-cpp-python==0.3.36 >&2
    sdist="$out/llama_cpp_python-0.3.36.tar.gz"
fi
src="$out/llama_cpp_python-0.3.36/vendor/llama.cpp"
[ -d "$src" ] || tar -C "$out" -xzf "$sdist"

case "$class" in
avx2)
    flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
        -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
    cxx=g++
    ;;
native)
    flags=(-DGGML_NATIVE=ON)
    cxx=g++
    ;;
sse42)
    flags=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF
        -DGGML_BMI2=OFF -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
    cxx=g++
    ;;
cortex-a76 | cortex-a72)
    flags=(-DGGML_NATIVE=OFF -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64
        -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++
        "-DCMAKE_C_FLAGS=-mcpu=$class" "-DCMAKE_CXX_FLAGS=-mcpu=$class")
    cxx="aarch64-linux-gnu-g++ -mcpu=$class"
    command -v aarch64-linux-gnu-g++ >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        gcc-aarch64-linux-gnu g++-aarch64-linux-gnu >&2
    ;;
*)
    echo "unknown CPU class: $class" >&2
    exit 2
    ;;
esac
build="$out/build-$class"
t0=$(date +%s)
# static libraries only, no OpenMP (one thread is counted), none of llama.cpp's tools
nice -n 10 cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF \
    -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    "${flags[@]}" >"$build.log" 2>&1 || { tail -n 30 "$build.log" >&2; exit 1; }
nice -n 10 cmake --build "$build" --target llama -j "${BUILD_JOBS:-1}" >>"$build.log" 2>&1 || { tail -n 30 "$build.log" >&2; exit 1; }
libs=$(find "$build" -name 'libllama.a' -o -name 'libggml*.a' | sort -r)
# shellcheck disable=SC2086 # $cxx carries the target's flag; the libraries twice: static link order
nice -n 10 $cxx -O2 -std=c++17 -static -I"$src/include" -I"$src/ggml/include" "$here/llama_count.cpp" \
    $libs $libs -lpthread -o "$binary"
echo "built $binary in $(($(date +%s) - t0)) s" >&2
echo "$binary"
