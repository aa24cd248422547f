#!/usr/bin/env bash
# cpuinfo.sh CORE: a /proc/cpuinfo for CORE (tests/arm64/cpuinfo/CORE.txt), one entry per CPU of the host.
set -euo pipefail
block="$(dirname "$0")/cpuinfo/$1.txt"
[ -f "$block" ] || { echo "no cpuinfo for core $1 (have: $(ls "$(dirname "$0")/cpuinfo"))" >&2; exit 1; }
last="$(sed 's/.*[-,]//' /sys/devices/system/cpu/possible 2>/dev/null || echo $(($(nproc) - 1)))"
for i in $(seq 0 "$last"); do
    printf 'processor\t: %d\n' "$i"
    cat "$block"
    echo
done
