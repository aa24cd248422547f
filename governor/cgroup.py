"""The process's cgroup (v1 or v2): memory limit and usage, CPU quota, usable CPUs.

Roots are parameters (cgroup_root, proc_root) so tests read fixture trees.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from governor.sysfiles import read_int, read_limit, read_stat, read_text


def _proc_cgroup_paths(proc_root: Path) -> dict[str, str]:
    """Controller -> cgroup path of this process, from <proc_root>/self/cgroup. v2 is under key ""."""
    text = read_text(proc_root / "self" / "cgroup")
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for controller in controllers.split(","):
            if controller:
                out[controller] = path
    return out


def _cgroup_chain(mount: Path, rel: str) -> list[Path]:
    """The process's cgroup directory and its ancestors up to the mount, innermost first.

    Inside a container without a cgroup namespace /proc/self/cgroup names the host path
    (/docker/<id>) while the mount already is that cgroup: then only the mount itself is readable.
    """
    leaf = mount / rel.strip("/") if rel.strip("/") else mount
    if not leaf.is_dir():
        return [mount] if mount.is_dir() else []
    chain = [leaf]
    while chain[-1] != mount and mount in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _v1_mount(cgroup_root: Path, controller: str) -> Path | None:
    """The v1 hierarchy holding `controller`: <root>/memory, or a co-mounted <root>/cpu,cpuacct."""
    direct = cgroup_root / controller
    if direct.is_dir():
        return direct
    try:
        for d in cgroup_root.iterdir():
            if d.is_dir() and controller in d.name.split(","):
                return d
    except OSError:
        pass
    return None


def _is_v2(cgroup_root: Path) -> bool:
    return (cgroup_root / "cgroup.controllers").is_file()


@dataclass(frozen=True)
class CgroupMemory:
    version: str  # "cgroup-v2" | "cgroup-v1"
    limit_bytes: int | None  # smallest limit up the hierarchy, None if unlimited
    used_bytes: int | None  # usage where that limit is set, minus inactive file cache


def read_cgroup_memory(
    cgroup_root: Path | str = "/sys/fs/cgroup", proc_root: Path | str = "/proc"
) -> CgroupMemory | None:
    cgroup_root, proc_root = Path(cgroup_root), Path(proc_root)
    paths = _proc_cgroup_paths(proc_root)
    if _is_v2(cgroup_root):
        chain = _cgroup_chain(cgroup_root, paths.get("", "/"))
        return _smallest(
            "cgroup-v2",
            chain,
            limits=lambda d: [read_limit(d / "memory.max"), read_limit(d / "memory.high")],
            usage=lambda d: _usage(d / "memory.current", d / "memory.stat", ("inactive_file",)),
        )
    mount = _v1_mount(cgroup_root, "memory")
    if mount is None:
        return None
    chain = _cgroup_chain(mount, paths.get("memory", "/"))
    return _smallest(
        "cgroup-v1",
        chain,
        limits=lambda d: [read_limit(d / "memory.limit_in_bytes")],
        usage=lambda d: _usage(
            d / "memory.usage_in_bytes", d / "memory.stat", ("total_inactive_file", "inactive_file")
        ),
    )


def _usage(current: Path, stat: Path, inactive_keys: tuple[str, ...]) -> int | None:
    used = read_int(current)
    if used is None:
        return None
    stats = read_stat(stat)
    inactive = next((stats[k] for k in inactive_keys if k in stats), 0)
    return max(0, used - inactive)


def _smallest(
    version: str,
    chain: list[Path],
    limits: Callable[[Path], list[int | None]],
    usage: Callable[[Path], int | None],
) -> CgroupMemory | None:
    if not chain:
        return None
    best: tuple[int, Path] | None = None
    for d in chain:
        for limit in limits(d):
            if limit is not None and (best is None or limit < best[0]):
                best = (limit, d)
    # Usage where the limit applies (siblings count against a parent's limit); the own cgroup otherwise.
    where = best[1] if best else chain[0]
    return CgroupMemory(version, best[0] if best else None, usage(where))


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_quota(cgroup_root: Path | str = "/sys/fs/cgroup", proc_root: Path | str = "/proc") -> float | None:
    """The smallest CPU quota (in CPUs) up the process's cgroup hierarchy, None if unlimited."""
    cgroup_root, proc_root = Path(cgroup_root), Path(proc_root)
    paths = _proc_cgroup_paths(proc_root)
    quotas: list[float] = []
    if _is_v2(cgroup_root):
        for d in _cgroup_chain(cgroup_root, paths.get("", "/")):
            fields = (read_text(d / "cpu.max") or "").split()
            if len(fields) == 2 and fields[0] != "max":
                try:
                    quota, period = int(fields[0]), int(fields[1])
                except ValueError:
                    continue
                if quota > 0 and period > 0:
                    quotas.append(quota / period)
    else:
        mount = _v1_mount(cgroup_root, "cpu")
        for d in _cgroup_chain(mount, paths.get("cpu", "/")) if mount else []:
            quota, period = read_int(d / "cpu.cfs_quota_us"), read_int(d / "cpu.cfs_period_us")
            if quota is not None and period and quota > 0:
                quotas.append(quota / period)
    return min(quotas) if quotas else None


def usable_cpus(
    cgroup_root: Path | str = "/sys/fs/cgroup",
    proc_root: Path | str = "/proc",
    *,
    affinity: int | None = None,
) -> int:
    """min(CPUs we may run on, the cgroup quota) rounded down, at least 1. Thread pools size from this:
    sizing them from physical cores inside a quota is the 45x slowdown of Ollama issue 17916."""
    count = affinity if affinity is not None else _affinity_count()
    quota = cpu_quota(cgroup_root, proc_root)
    if quota is not None:
        count = min(count, math.floor(quota))
    return max(1, count)
