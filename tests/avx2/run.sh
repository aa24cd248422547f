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
# SIMMER_HOME of its own. One process (no pytest-xdist: its workers would start natively).
set -euo pipefail
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
tests="${AVX2_TESTS:-tests/models/test_batch.py tests/models/test_prefix_exact.py tests/server/test_batch_serving.py tests/bench/experiments}"
# qemu warns once per CPU feature the host has and TCG cannot show; the test output is what matters
# shellcheck disable=SC2086
nice -n 19 qemu-x86_64 .venv/bin/python -m pytest -p no:xdist -p no:cacheprovider -rs $tests "$@" \
    2> >(grep -v "TCG doesn't support requested feature" >&2)
