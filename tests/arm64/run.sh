#!/usr/bin/env bash
# `make test-arm64`: simmer's tests on arm64, in a Debian bookworm arm64 root filesystem under qemu-user, as a
# user there installs and runs them.
#
#   tests/arm64/run.sh            the not-slow suite, then the exact-answer end-to-end test (pull, serve, chat)
#   tests/arm64/run.sh quality    studies.experiments.quality (KL of each variant from the fp32 reference) on
#                                 each emulated core: cortex-a72 (no dot product), cortex-a76 (dot product),
#                                 max (+ i8mm); one JSON per core into $SIMMER_ARM64_OUT (default studies/results)
#   tests/arm64/run.sh shell [CMD...]   a shell (or CMD) in the root, the working tree at /src
#   tests/arm64/run.sh count      only the instruction count of the tiny model's decode steps (below)
#
# 1. the cached root filesystem with the dependencies installed (tests/arm64/rootfs.sh; built on the first
#    run or when pyproject.toml's [project] table changes, ~30 min on 2 cores; reused after)
# 2. unpacked into a temporary folder; the working tree (tracked and untracked files, not ignored ones) is
#    copied to /src beside the cached /src/.venv
# 3. the tests that depend on the architecture (tests/models, tests/governor; ARM64_TESTS=tests: all of them)
#    as `make test` runs them (pytest -n 2 --dist loadfile), minus the slow ones, then the one slow end-to-end
#    test; pulls and converted models are cached in $SIMMER_ARM64_CACHE/simmer-test
# 4. on the host, the tiny model's decode steps counted on the emulated core (bench/cpu_cost, docs/cpu-classes.md)
# Everything emulated runs under nice -n 19. Each step prints its wall time; the last line is the verdict.
#
# env: QEMU_CPU (cortex-a76: the core emulated, and the /proc/cpuinfo shown), SIMMER_ARM64_CACHE
#      (~/.cache/simmer-arm64), ARM64_TESTS (tests/models tests/governor), PYTEST_ARGS (extra arguments for
#      the not-slow run), SIMMER_ARM64_OUT, SIMMER_ARM64_VARIANTS (the variants studies.experiments.quality
#      measures: q4,q4-a8)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=tests/arm64/host.sh
source "$repo/tests/arm64/host.sh"
mode="${1:-test}"
[ $# -gt 0 ] && shift
export QEMU_CPU="${QEMU_CPU:-cortex-a76}"

t0=$(date +%s)
t_step=$t0
step() {
    local now
    now=$(date +%s)
    printf '\n== [%5ds, previous step %5ds] %s\n' "$((now - t0))" "$((now - t_step))" "$*"
    t_step=$now
}

step "host: qemu-user-static + binfmt_misc, the cached arm64 root filesystem"
arm64_host_ready
tarball="$(bash "$arm64_here/rootfs.sh")"
echo "root filesystem: $tarball"

work="$(mktemp -d /var/tmp/simmer-arm64-run.XXXXXX)"
trap 'rm -rf "$work"' EXIT
root="$work/root"
mkdir -p "$root"
step "unpack the root filesystem, copy the working tree to /src"
zstd -q -d -c "$tarball" | tar -C "$root" --numeric-owner -xf -
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | (cd "$repo" && tar --null --ignore-failed-read -T - -cf -) | tar -C "$root/src" -xf -
# The venv was made from this [project] table (the tarball's key): make's stamp stays current.
touch "$root/src/.venv/.simmer-installed"

run_in() { # run_in CORE CMD...: CMD in the root on the emulated CORE, its /proc/cpuinfo to match
    local core=$1 cpuinfo="$work/cpuinfo-$1"
    shift
    bash "$arm64_here/cpuinfo.sh" "$core" >"$cpuinfo"
    QEMU_CPU="$core" in_root "$root" "$cpuinfo" "$@"
}

case "$mode" in
test)
    # What depends on the architecture: onnxruntime's kernels, numpy, tokenizers, the GGUF and ONNX code
    # (tests/models), psutil and the sensors (tests/governor). The server's tests run the same Python on
    # any CPU, and emulated the whole suite takes hours: ARM64_TESTS=tests runs it all.
    tests="${ARM64_TESTS:-tests/models tests/governor}"
    step "in the root ($QEMU_CPU): make .venv/.simmer-installed (README), then pytest -m 'not slow' -n 2 $tests"
    set +e
    # shellcheck disable=SC2016
    run_in "$QEMU_CPU" bash -c 'cd /src && make .venv/.simmer-installed PYTHON=python3 >/dev/null \
        && .venv/bin/python -c "import platform, onnxruntime; print(platform.machine(), \"onnxruntime\", onnxruntime.__version__)" \
        && .venv/bin/python -m pytest -m "not slow" -n 2 --dist loadfile -q -p no:cacheprovider --durations=25 '"$tests ${PYTEST_ARGS:-}"
    suite=$?
    step "in the root ($QEMU_CPU): the end-to-end test (simmer pull, simmer serve, a greedy chat against x86's answer)"
    run_in "$QEMU_CPU" bash -c 'cd /src && .venv/bin/python -m pytest -q -p no:cacheprovider -rA --durations=5 tests/test_exact_answer_e2e.py'
    e2e=$?
    # From the host: the instruction counter needs Debian's dynamic qemu-aarch64 (-plugin), which runs the
    # root's Python through -L; its first run builds the plugin and llama.cpp for the core (~10 min).
    step "on the host: count the tiny model's decode steps on cortex-a76 (tests/bench/test_cpu_cost.py)"
    command -v qemu-aarch64 >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user >/dev/null
    (cd "$repo" && SIMMER_ARM64_ROOT="$root" nice -n 10 "${SIMMER_HOST_PYTHON:-$repo/.venv/bin/python}" -m pytest \
        -q -p no:cacheprovider -rA tests/bench/test_cpu_cost.py -k cortex_a76)
    counted=$?
    set -e
    step "verdict"
    echo "not-slow suite: exit $suite; end-to-end: exit $e2e; counted: exit $counted" \
        "(QEMU_CPU=$QEMU_CPU, wall $(($(date +%s) - t0)) s)"
    [ "$suite" -eq 0 ] && [ "$e2e" -eq 0 ] && [ "$counted" -eq 0 ]
    ;;
quality)
    out="${SIMMER_ARM64_OUT:-$repo/studies/results}"
    mkdir -p "$out"
    ARM64_BINDS="$out:/out"
    export ARM64_BINDS
    # The GGUF (the test suite's cached download) and one conversion (CPU-independent: the same files on any
    # machine), shared by the cores.
    prepare='from tests.conftest import _fetch_smollm2, build_once, converted_cache_dir, test_cache_dir
c = test_cache_dir(); t = c / "SmolLM2-135M-Instruct.Q4_1.gguf"
build_once(t, lambda: t.exists(), lambda: _fetch_smollm2(c, t))
print(t, converted_cache_dir() / "quality-smollm2")'
    read -r gguf model_dir < <(run_in "$QEMU_CPU" bash -c 'cd /src && .venv/bin/python -c "$1"' _ "$prepare" | tail -n 1)
    for core in ${SIMMER_ARM64_CORES:-cortex-a72 cortex-a76 max}; do
        step "studies.experiments.quality on $core"
        run_in "$core" bash -c "cd /src && .venv/bin/python -m studies.experiments.quality --gguf $gguf --model-dir $model_dir \
            --variants ${SIMMER_ARM64_VARIANTS:-q4,q4-a8} --no-peer --json /out/quality-arm64-$core.json"
    done
    step "done: $out/quality-arm64-*.json"
    ;;
count)
    step "on the host: count the tiny model's decode steps on cortex-a76 (tests/bench/test_cpu_cost.py)"
    cd "$repo" && SIMMER_ARM64_ROOT="$root" nice -n 10 "${SIMMER_HOST_PYTHON:-$repo/.venv/bin/python}" -m pytest \
        -q -p no:cacheprovider -rA tests/bench/test_cpu_cost.py -k cortex_a76
    ;;
shell)
    run_in "$QEMU_CPU" bash -c 'cd /src && exec "${@:-bash}"' shell "$@"
    ;;
*)
    echo "usage: $0 [test|quality|count|shell [CMD...]]" >&2
    exit 2
    ;;
esac
