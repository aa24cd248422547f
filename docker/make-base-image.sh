#!/usr/bin/env bash
# Build a local stand-in for python:3.11-slim when Docker Hub is unreachable.
#
# Debian bookworm ships Python 3.11, so a minimal debootstrap of bookworm with python3 is close enough to the
# official slim image for our Dockerfile (it only needs `python -m venv` and pip). The image is cached: if the
# tag already exists, nothing is done.
#
#   usage: docker/make-base-image.sh [TAG]        (default TAG: simmer-base:bookworm-py311)
#   env:   SIMMER_DEBIAN_MIRROR  override the mirror (default: the first Debian mirror in /etc/apt/sources.list*)
set -euo pipefail

tag="${1:-simmer-base:bookworm-py311}"

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag already exists"
    exit 0
fi

# The machine's own Debian mirror is the one we know is reachable from here.
find_mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*)
    grep -hsE '^[[:space:]]*(URIs:|deb )' "${files[@]}" \
        | grep -oE 'https?://[^ ]+/debian/?' \
        | grep -v -- '-security' \
        | head -n 1
}
mirror="${SIMMER_DEBIAN_MIRROR:-$(find_mirror || true)}"
mirror="${mirror:-http://deb.debian.org/debian}"

if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
fi

rootfs="$(mktemp -d /tmp/simmer-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

echo "debootstrap bookworm from $mirror into $rootfs"
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -n 30 "$rootfs.log"
    exit 1
}
rm -f "$rootfs.log"

# Trust the same extra CAs as this machine: where egress goes through a TLS-inspecting proxy, pip (and the model
# download) inside `docker build` fail without them. This image is a local stand-in, so local trust is right.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null
fi

# Make it look like python:3.11-slim where our Dockerfile cares: `python` on PATH in /usr/local/bin.
ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python3"
# Smaller image: no package lists or caches (nothing installs packages into it later).
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*

tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$tag" >/dev/null
echo "built base image $tag"
