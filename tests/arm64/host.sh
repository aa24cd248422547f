# Sourced by the arm64 scripts: what the host needs to run arm64 programs (qemu-user-static registered with
# binfmt_misc), the cache folder, and `in_root` to run a command in an arm64 root filesystem.
#
# env: SIMMER_ARM64_CACHE (~/.cache/simmer-arm64): the rootfs tarballs, pip's cache, the model cache
#      SIMMER_DEBIAN_MIRROR: the mirror debootstrap uses (default: the host's own Debian mirror)

arm64_cache="${SIMMER_ARM64_CACHE:-$HOME/.cache/simmer-arm64}"
arm64_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$arm64_cache"

arm64_log() { printf '== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# qemu-user-static, binfmt-support and debootstrap from Debian's packages, when missing; qemu registered
# with binfmt_misc with the F flag (the interpreter is opened at registration, so a chroot needs no copy).
arm64_host_ready() {
    local missing=()
    command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
    command -v update-binfmts >/dev/null || missing+=(binfmt-support)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if [ "${#missing[@]}" -gt 0 ]; then
        arm64_log "installing ${missing[*]} (apt-get)"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] && [ -e /usr/lib/binfmt.d/qemu-aarch64.conf ]; then
        # no systemd-binfmt in a container: register Debian's own line by hand
        sed -n 's/^[^#]/&/p' /usr/lib/binfmt.d/qemu-aarch64.conf >/proc/sys/fs/binfmt_misc/register
    fi
    grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null || {
        echo "qemu-aarch64 is not registered with binfmt_misc (flag F): cannot run arm64 programs here" >&2
        return 1
    }
}

arm64_mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*) m
    m="$(grep -hsE '^[[:space:]]*(URIs:|deb )' "${files[@]}" | grep -oE 'https?://[^ ]+/debian/?' \
        | grep -v -- '-security' | head -n 1 || true)"
    echo "${SIMMER_DEBIAN_MIRROR:-${m:-http://deb.debian.org/debian}}"
}

# trust_host_cas ROOT: this machine's extra CAs (/usr/local/share/ca-certificates, e.g. a TLS-inspecting
# proxy's) trusted in ROOT too, without running its update-ca-certificates (emulated, a quarter of an hour):
# copied where a later update-ca-certificates keeps them, and appended to the bundle that pip and Python use.
trust_host_cas() {
    local root=$1 crt
    compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null || return 0
    for crt in /usr/local/share/ca-certificates/*.crt; do
        cp "$crt" "$root/usr/local/share/ca-certificates/"
        cat "$crt" >>"$root/etc/ssl/certs/ca-certificates.crt"
    done
}

# in_root ROOT CPUINFO CMD...: CMD in ROOT under chroot (nice -n 19), in a private mount namespace (every mount goes away
# with the process, whatever kills it): /proc with CPUINFO over /proc/cpuinfo, /dev, /sys read-only, the host's
# DNS, pip's cache and the model cache from $arm64_cache. Extra bind mounts: ARM64_BINDS="host:inside ...";
# extra environment: ARM64_ENV="KEY=VALUE ...".
in_root() {
    local root=$1 cpuinfo=$2
    shift 2
    mkdir -p "$arm64_cache/pip" "$arm64_cache/simmer-test"
    # shellcheck disable=SC2016
    # nice: everything in the root runs emulated, the slowest work on the machine
    nice -n 19 unshare --mount --propagation private bash -euc '
        root=$1 cpuinfo=$2 cache=$3 binds=$4; shift 4
        mount -t proc proc "$root/proc"
        mount --bind "$cpuinfo" "$root/proc/cpuinfo"
        mount --rbind /dev "$root/dev"
        mkdir -p "$root/dev/shm" && mount -t tmpfs -o size=1g tmpfs "$root/dev/shm"
        mount --rbind /sys "$root/sys" && mount -o remount,bind,ro "$root/sys" 2>/dev/null || true
        home="$root/root" # the home of root, inside
        mkdir -p "$home/.cache/pip" "$home/.cache/simmer-test"
        mount --bind "$cache/pip" "$home/.cache/pip"
        mount --bind "$cache/simmer-test" "$home/.cache/simmer-test"
        for b in $binds; do mkdir -p "$root/${b#*:}"; mount --bind "${b%%:*}" "$root/${b#*:}"; done
        cp -L /etc/resolv.conf "$root/etc/resolv.conf"
        exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
            SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
            REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
            ${QEMU_CPU:+QEMU_CPU=$QEMU_CPU} ${ARM64_ENV:-} "$@"
    ' in_root "$root" "$cpuinfo" "$arm64_cache" "${ARM64_BINDS:-}" "$@"
}
