#!/usr/bin/env bash
# Build a local stand-in for python:3.11-slim when Docker Hub is unreachable.
#
# Debian bookworm ships Python 3.11, so a minimal debootstrap of bookworm with python3 is close enough to the
# official slim image for our Dockerfile (it only needs `python -m venv` and pip). The image is cached: if the
# tag already exists, nothing is done.
#
#   usage: docker/make-base-image.sh [TAG [PLATFORM]]   (default TAG: simmer-base:bookworm-py311, PLATFORM:
#          this machine's; linux/amd64 or linux/arm64)
#   env:   SIMMER_DEBIAN_MIRROR  override the mirror (default: the first Debian mirror in /etc/apt/sources.list*)
#
# Another architecture than this machine's (linux/arm64 on x86) runs debootstrap's second stage under
# qemu-user (qemu-user-static and binfmt_misc, installed from Debian's packages when missing: the image's
# programs then run emulated in `docker build` and `docker run` too); the image is imported for that platform.
set -euo pipefail

tag="${1:-simmer-base:bookworm-py311}"
native="$(dpkg --print-architecture)"
platform="${2:-linux/$native}"
arch="${platform#linux/}"
case "$arch" in
amd64 | arm64) ;;
*)
    echo "unsupported platform $platform (linux/amd64 or linux/arm64)" >&2
    exit 2
    ;;
esac

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

if [ "$arch" != "$native" ]; then
    # shellcheck source=tests/arm64/host.sh
    source "$(dirname "$0")/../tests/arm64/host.sh"
    arm64_host_ready
fi

rootfs="$(mktemp -d /tmp/simmer-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

echo "debootstrap bookworm $arch from $mirror into $rootfs"
nice -n 19 debootstrap --arch="$arch" --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -n 30 "$rootfs.log"
    exit 1
}
rm -f "$rootfs.log"

# Trust the same extra CAs as this machine: where egress goes through a TLS-inspecting proxy, pip (and the model
# download) inside `docker build` fail without them. This image is a local stand-in, so local trust is right.
if [ "$arch" != "$native" ]; then
    trust_host_cas "$rootfs" # update-ca-certificates, emulated, takes a quarter of an hour
elif compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null
fi

# Make it look like python:3.11-slim where our Dockerfile cares: `python` on PATH in /usr/local/bin.
ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python3"
# Smaller image: no package lists or caches (nothing installs packages into it later).
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*

# `docker build --platform` of the tree, not `docker import`: an engine without the containerd image store
# labels an imported image with its own architecture whatever --platform says, and `docker build --platform
# linux/arm64` would then not find an arm64 base.
context="$(mktemp -d /tmp/simmer-base-context.XXXXXX)"
trap 'rm -rf "$rootfs" "$context"' EXIT
tar -C "$rootfs" --numeric-owner -cf "$context/rootfs.tar" .
cat >"$context/Dockerfile" <<'DOCKERFILE'
FROM scratch
ADD rootfs.tar /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
CMD ["python3"]
DOCKERFILE
docker build -q --platform "$platform" -t "$tag" "$context" >/dev/null
[ "$(docker image inspect -f '{{.Os}}/{{.Architecture}}' "$tag")" = "$platform" ] \
    || { echo "$tag is not a $platform image" >&2; exit 1; }
echo "built base image $tag ($platform)"
