#!/usr/bin/env bash
# The cached Debian bookworm arm64 root filesystem with simmer's dependencies installed, as a tarball.
#
#   usage: tests/arm64/rootfs.sh            prints the tarball's path (built first if it is not cached)
#
# Two layers, each a zstd tarball in $SIMMER_ARM64_CACHE (~/.cache/simmer-arm64):
#   base-<recipe>.tar.zst     debootstrap of bookworm arm64 (python3, venv, pip, make): the second stage
#                             runs under qemu-user; keyed by its package list
#   venv-<pyproject>-<recipe>.tar.zst   the base plus /src/.venv made by `make .venv/.simmer-installed`
#                             from the project's source (what the README does), keyed by pyproject.toml's hash
# Building the base takes ~10 minutes on 2 shared cores, the venv ~20 more (pip runs emulated); a cached
# tarball is reused as is. Older tarballs of either layer are removed when a new one is built.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=tests/arm64/host.sh
source "$repo/tests/arm64/host.sh"

# What the base is made of: a change here makes a new base (and so a new venv layer).
packages=python3,python3-venv,python3-pip,ca-certificates,make
recipe="$(echo "bookworm arm64 minbase $packages hosts+ca v1" | sha256sum | cut -c1-12)"
# Keyed by what the venv is made of (the [project] table: dependencies, extras, scripts), not by the whole
# pyproject.toml: a lint setting or an import contract changes nothing installed.
deps="$(python3 -c 'import json, sys, tomllib; print(json.dumps(tomllib.load(open(sys.argv[1], "rb"))["project"], sort_keys=True))' \
    "$repo/pyproject.toml" | sha256sum | cut -c1-12)"
base="$arm64_cache/base-$recipe.tar.zst"
venv="$arm64_cache/venv-$deps-$recipe.tar.zst"

if [ -f "$venv" ]; then
    echo "$venv"
    exit 0
fi
arm64_host_ready >&2
command -v zstd >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q zstd >/dev/null

work="$(mktemp -d /var/tmp/simmer-arm64-build.XXXXXX)"
trap 'rm -rf "$work"' EXIT
root="$work/root"
mkdir -p "$root"

pack() { # pack DIR TARBALL: atomically
    tar -C "$1" --numeric-owner -cf - . | zstd -q -T0 -3 -o "$2.tmp"
    mv "$2.tmp" "$2"
}

if [ ! -f "$base" ]; then
    mirror="$(arm64_mirror)"
    arm64_log "debootstrap bookworm arm64 from $mirror (second stage under qemu-user; ~10 min)" >&2
    # nice: the second stage runs every package's scripts emulated
    nice -n 19 debootstrap --arch=arm64 --variant=minbase \
        --include="$packages" \
        bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
        tail -n 30 "$work/debootstrap.log" >&2
        exit 1
    }
    # Download tests talk to a server on `localhost`: debootstrap leaves /etc/hosts out.
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
    # Trust the host's extra CAs (a TLS-inspecting egress proxy): pip inside must reach PyPI like the host.
    # Appended to the bundle by hand: update-ca-certificates, emulated, takes a quarter of an hour.
    trust_host_cas "$root"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    rm -f "$arm64_cache"/base-*.tar.zst
    pack "$root" "$base"
    arm64_log "cached $base ($(du -h "$base" | cut -f1))" >&2
else
    arm64_log "reusing $base" >&2
    zstd -q -d -c "$base" | tar -C "$root" --numeric-owner -xf -
fi

arm64_log "installing simmer and its dependencies in the arm64 root (make .venv/.simmer-installed, pip emulated)" >&2
mkdir -p "$root/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | (cd "$repo" && tar --null --ignore-failed-read -T - -cf -) | tar -C "$root/src" -xf -
cpuinfo="$work/cpuinfo"
bash "$arm64_here/cpuinfo.sh" cortex-a76 >"$cpuinfo"
# PIP_NO_COMPILE: emulated, compiling every installed module's bytecode up front costs more than the modules a
# run imports compile at first import.
# Three tries: one dropped connection to PyPI late in a half-hour emulated install should not lose it (pip
# keeps what it downloaded in its cache, so a retry resumes).
QEMU_CPU=cortex-a76 ARM64_ENV=PIP_NO_COMPILE=1 in_root "$root" "$cpuinfo" \
    bash -c 'cd /src && for try in 1 2 3; do make .venv/.simmer-installed PYTHON=python3 && break; [ $try = 3 ] && exit 1; echo "pip failed (try $try of 3), again" >&2; done && .venv/bin/python -c "import onnxruntime, server, models, governor; print(\"onnxruntime\", onnxruntime.__version__)"' >&2
# The source is copied in fresh on every run; only the venv (and its stamp) stay in the tarball.
find "$root/src" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
rm -f "$arm64_cache"/venv-*.tar.zst
pack "$root" "$venv"
arm64_log "cached $venv ($(du -h "$venv" | cut -f1))" >&2
echo "$venv"
