#!/usr/bin/env bash
# `make test-avx2`: the tests whose results depend on the CPU's kernels, on an emulated x86 CPU without
# AVX-512 (Haswell: AVX2, FMA, no VNNI) under qemu-user, on any x86_64 machine. Not part of CI: about
# twenty times slower than native (docs/development.md).
#
#   tests/avx2/run.sh [PYTEST_ARGS...]
#
# env: QEMU_CPU (Haswell: the CPU onnxruntime's kernel dispatch sees), AVX2_TESTS (the files below).
# qemu-user shows the guest the host's /proc/cpuinfo, so simmer's measured.json facts (keyed by it) would
# be the host's: the tests here only write into temporary folders, and a server run this way should get a
# SIMMER_HOME of its own. One process per file (no pytest-xdist: its workers would start natively).
# qemu-user 7.2 now and then dies (SIGSEGV) in a test with many client threads: a file whose process dies
# is run again one test per process, each tried twice, and the verdict counts what those say.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
if [ "$(uname -m)" != x86_64 ]; then
    echo "test-avx2 emulates an x86 CPU on an x86_64 machine; this one is $(uname -m)" >&2
    exit 2
fi
if ! command -v qemu-x86_64 >/dev/null; then
    apt-get update -q && apt-get install -y -q qemu-user
fi
export QEMU_CPU="${QEMU_CPU:-Haswell}"
tests="${AVX2_TESTS:-tests/models/runtime/test_batch.py tests/models/runtime/test_prefix_exact.py tests/server/serving/test_batch_serving.py tests/studies/experiments}"
emulated() {  # pytest under qemu; qemu's warning per CPU feature it cannot show is dropped
    nice -n 19 qemu-x86_64 .venv/bin/python -m pytest -p no:xdist -p no:cacheprovider -q -rs "$@" 2>&1 |
        grep -v "TCG doesn't support requested feature"
    return "${PIPESTATUS[0]}"
}
failed=0
for file in $tests; do
    echo "== $file (QEMU_CPU=$QEMU_CPU)"
    emulated "$file" "$@"
    rc=$?
    if [ "$rc" -ge 128 ]; then
        echo "== $file: qemu died (exit $rc); again, one test per process"
        for id in $(.venv/bin/python -m pytest --collect-only -q -p no:cacheprovider "$file" "$@" | grep "::"); do
            emulated "$id" "$@" || { [ $? -ge 128 ] && emulated "$id" "$@"; } || failed=1
        done
    elif [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        failed=1
    fi
done
# the instruction counter on the tiny model (it runs qemu itself; builds llama.cpp for AVX2 the first time)
echo "== tests/bench/test_cpu_cost.py (counted under qemu-x86_64 -cpu Haswell)"
SIMMER_COUNT_CPU=1 .venv/bin/python -m pytest -p no:cacheprovider -q -rs tests/bench/test_cpu_cost.py || failed=1
[ "$failed" -eq 0 ] && echo "test-avx2: passed" || echo "test-avx2: FAILED"
exit "$failed"
