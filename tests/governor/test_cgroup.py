from pathlib import Path
from types import SimpleNamespace

import pytest

from governor.cgroup import cpu_quota, read_cgroup_memory, usable_cpus
from governor.sensors import read_memory, read_psi_memory

MiB = 2**20
V1_UNLIMITED = "9223372036854771712"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def proc_tree(tmp_path: Path, cgroup_lines: str, psi: str | None = None) -> Path:
    proc = tmp_path / "proc"
    write(proc, "self/cgroup", cgroup_lines)
    if psi is not None:
        write(proc, "pressure/memory", psi)
    return proc


def v2_tree(tmp_path: Path) -> tuple[Path, Path]:
    """/app.slice (limit 512 MiB) > /app.slice/simmer (max 1 GiB, high 768 MiB)."""
    cg = tmp_path / "cgroup"
    write(cg, "cgroup.controllers", "cpu memory")
    write(cg, "app.slice/memory.max", str(512 * MiB))
    write(cg, "app.slice/memory.high", "max")
    write(cg, "app.slice/memory.current", str(400 * MiB))
    write(cg, "app.slice/memory.stat", f"anon 1000\ninactive_file {100 * MiB}\nactive_file 5")
    write(cg, "app.slice/cpu.max", "150000 100000")
    write(cg, "app.slice/simmer/memory.max", str(1024 * MiB))
    write(cg, "app.slice/simmer/memory.high", str(768 * MiB))
    write(cg, "app.slice/simmer/memory.current", str(300 * MiB))
    write(cg, "app.slice/simmer/memory.stat", f"inactive_file {50 * MiB}")
    write(cg, "app.slice/simmer/cpu.max", "max 100000")
    proc = proc_tree(tmp_path, "0::/app.slice/simmer")
    return cg, proc


def v1_tree(tmp_path: Path, *, own_limit: int | None, parent_limit: int | None) -> tuple[Path, Path]:
    cg = tmp_path / "cgroup"
    write(cg, "memory/memory.limit_in_bytes", V1_UNLIMITED)
    write(cg, "memory/memory.usage_in_bytes", str(4000 * MiB))
    parent, own = "memory/docker", "memory/docker/abc"
    write(cg, f"{parent}/memory.limit_in_bytes", str(parent_limit) if parent_limit else V1_UNLIMITED)
    write(cg, f"{parent}/memory.usage_in_bytes", str(900 * MiB))
    write(cg, f"{parent}/memory.stat", f"inactive_file 1\ntotal_inactive_file {100 * MiB}")
    write(cg, f"{own}/memory.limit_in_bytes", str(own_limit) if own_limit else V1_UNLIMITED)
    write(cg, f"{own}/memory.usage_in_bytes", str(600 * MiB))
    write(cg, f"{own}/memory.stat", f"total_inactive_file {200 * MiB}")
    write(cg, "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000")
    write(cg, "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000")
    write(cg, "cpu,cpuacct/docker/cpu.cfs_quota_us", "-1")
    write(cg, "cpu,cpuacct/docker/cpu.cfs_period_us", "100000")
    proc = proc_tree(
        tmp_path,
        "12:pids:/docker/abc\n4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/",
        psi="some avg10=12.50 avg60=3.00 avg300=1.00 total=100\n"
        "full avg10=6.25 avg60=1.00 avg300=0.00 total=5",
    )
    return cg, proc


def host(total_mib: int = 16384, available_mib: int = 12000) -> SimpleNamespace:
    return SimpleNamespace(total=total_mib * MiB, available=available_mib * MiB)


def test_v2_when_parent_limit_is_smaller_then_parent_limit_and_usage_win(tmp_path):
    cg, proc = v2_tree(tmp_path)
    mem = read_cgroup_memory(cg, proc)
    assert mem is not None
    assert mem.version == "cgroup-v2"
    assert mem.limit_bytes == 512 * MiB
    assert mem.used_bytes == 300 * MiB  # parent's memory.current 400 minus inactive_file 100


def test_v2_when_memory_high_is_the_smallest_then_it_is_the_limit(tmp_path):
    cg, proc = v2_tree(tmp_path)
    write(cg, "app.slice/memory.max", "max")
    mem = read_cgroup_memory(cg, proc)
    assert mem is not None
    assert mem.limit_bytes == 768 * MiB
    assert mem.used_bytes == 250 * MiB


def test_v1_when_own_limit_is_smallest_then_own_usage_minus_total_inactive_file(tmp_path):
    cg, proc = v1_tree(tmp_path, own_limit=700 * MiB, parent_limit=2048 * MiB)
    mem = read_cgroup_memory(cg, proc)
    assert mem is not None
    assert (mem.version, mem.limit_bytes, mem.used_bytes) == ("cgroup-v1", 700 * MiB, 400 * MiB)


def test_v1_when_nested_and_parent_smaller_then_parent_limit(tmp_path):
    cg, proc = v1_tree(tmp_path, own_limit=None, parent_limit=1024 * MiB)
    mem = read_cgroup_memory(cg, proc)
    assert mem is not None
    assert (mem.limit_bytes, mem.used_bytes) == (1024 * MiB, 800 * MiB)


def test_v1_when_unlimited_everywhere_then_no_limit_and_read_memory_reports_host(tmp_path):
    cg, proc = v1_tree(tmp_path, own_limit=None, parent_limit=None)
    mem = read_cgroup_memory(cg, proc)
    assert mem is not None and mem.limit_bytes is None
    reading = read_memory(cg, proc, host=host(), rss_fn=lambda: 123)
    assert reading is not None
    assert reading.source == "host"
    assert reading.limit_bytes == 16384 * MiB
    assert reading.available_bytes == 12000 * MiB
    assert reading.used_bytes == 4384 * MiB
    assert reading.rss_bytes == 123


def test_read_memory_when_cgroup_limit_below_ram_then_cgroup_source_and_psi(tmp_path):
    cg, proc = v1_tree(tmp_path, own_limit=700 * MiB, parent_limit=None)
    reading = read_memory(cg, proc, host=host(), rss_fn=lambda: 5)
    assert reading is not None
    assert reading.source == "cgroup-v1"
    assert (reading.limit_bytes, reading.used_bytes, reading.available_bytes) == (
        700 * MiB,
        400 * MiB,
        300 * MiB,
    )
    assert (reading.psi_some_avg10, reading.psi_full_avg10) == (12.5, 6.25)


def test_read_memory_when_host_has_less_free_than_the_cgroup_then_host_available_caps(tmp_path):
    cg, proc = v2_tree(tmp_path)
    reading = read_memory(cg, proc, host=host(available_mib=100), rss_fn=lambda: 5)
    assert reading is not None
    assert reading.source == "cgroup-v2"
    assert reading.available_bytes == 100 * MiB


def test_cgroup_when_container_path_not_visible_then_mount_root_is_used(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup names /docker/<id>, the mount is that cgroup."""
    cg = tmp_path / "cgroup"
    write(cg, "cgroup.controllers", "memory")
    write(cg, "memory.max", str(256 * MiB))
    write(cg, "memory.current", str(10 * MiB))
    proc = proc_tree(tmp_path, "0::/docker/0123abcd")
    mem = read_cgroup_memory(cg, proc)
    assert mem is not None and mem.limit_bytes == 256 * MiB and mem.used_bytes == 10 * MiB


def test_cgroup_when_files_missing_then_none_not_exception(tmp_path):
    assert read_cgroup_memory(tmp_path / "nothing", tmp_path / "noproc") is None
    assert read_psi_memory(tmp_path / "noproc") is None
    assert cpu_quota(tmp_path / "nothing", tmp_path / "noproc") is None
    reading = read_memory(tmp_path / "nothing", tmp_path / "noproc", host=host(), rss_fn=lambda: 1)
    assert reading is not None and reading.source == "host" and reading.psi_some_avg10 is None


def test_psi_when_garbage_then_none(tmp_path):
    proc = proc_tree(tmp_path, "0::/", psi="not a psi file")
    assert read_psi_memory(proc) is None


@pytest.mark.parametrize(
    ("affinity", "expected"),
    [(8, 1), (1, 1)],  # quota 1.5 CPUs at the parent -> 1
)
def test_usable_cpus_when_v2_quota_then_min_of_affinity_and_floor_quota(tmp_path, affinity, expected):
    cg, proc = v2_tree(tmp_path)
    assert cpu_quota(cg, proc) == pytest.approx(1.5)
    assert usable_cpus(cg, proc, affinity=affinity) == expected


def test_usable_cpus_when_v1_quota_then_floor_of_quota(tmp_path):
    cg, proc = v1_tree(tmp_path, own_limit=None, parent_limit=None)
    assert cpu_quota(cg, proc) == pytest.approx(2.5)
    assert usable_cpus(cg, proc, affinity=8) == 2
    assert usable_cpus(cg, proc, affinity=1) == 1


def test_usable_cpus_when_quota_below_one_cpu_then_at_least_one(tmp_path):
    cg = tmp_path / "cgroup"
    write(cg, "cgroup.controllers", "cpu")
    write(cg, "cpu.max", "50000 100000")
    proc = proc_tree(tmp_path, "0::/")
    assert usable_cpus(cg, proc, affinity=4) == 1


def test_usable_cpus_when_no_cgroup_then_affinity(tmp_path):
    assert usable_cpus(tmp_path / "x", tmp_path / "y", affinity=3) == 3
