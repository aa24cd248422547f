"""Count the guest instructions a program retires under qemu-user, split at its markers.

A CPU class here is what qemu emulates (`-cpu`) and what the peer's binary was built for; the count is the
instructions that class's code retires for the same work. It is work, not time: it cannot show caches,
memory stalls, how many instructions a core retires per cycle (a wide core runs two SIMD instructions
in one cycle, a narrow one in two), nor clocks. See docs/cpu-classes.md.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuClass:
    name: str
    qemu: str  # the dynamic qemu-user binary (the static ones cannot load plugins)
    qemu_cpu: str
    arch: str  # the guest's machine, as platform.machine() says it

    @property
    def emulated_arm(self) -> bool:
        return self.arch == "aarch64"


CLASSES = {
    # Haswell: AVX2 + FMA + F16C, no AVX-512: onnxruntime dispatches to its AVX2 kernels, llama.cpp's AVX2
    # build runs as built
    "avx2": CpuClass("avx2", "/usr/bin/qemu-x86_64", "Haswell", "x86_64"),
    "cortex-a76": CpuClass("cortex-a76", "/usr/bin/qemu-aarch64", "cortex-a76", "aarch64"),  # dot product
    "cortex-a72": CpuClass("cortex-a72", "/usr/bin/qemu-aarch64", "cortex-a72", "aarch64"),  # NEON only
}


# x86's `rep movsb`/`rep stosb` is one instruction on a real core, but TCG runs it one element at a time and
# the counter sees one instruction per byte: glibc's memcpy/memset pick it above a few KiB when the CPU has
# ERMS (Haswell does). Its thresholds set out of reach, they use their AVX2 loops, counted as they run.
OUT_OF_REACH = "0x7fffffffffffffff"
X86_COPY_LOOPS = (
    f"glibc.cpu.x86_rep_movsb_threshold={OUT_OF_REACH}:glibc.cpu.x86_rep_stosb_threshold={OUT_OF_REACH}"
)


@dataclass(frozen=True)
class Counted:
    total: int
    vcpus: int  # guest threads started: the plugin's adds are not atomic (insn_count.c)
    marks: list[int]
    stdout: str


def parse(text: str) -> tuple[int, int, list[int]]:
    """insn_count.c's output: (total, vcpus, marks)."""
    total, vcpus, marks = 0, 0, []
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "insns":
            total = int(value)
        elif key == "vcpus":
            vcpus = int(value)
        elif key == "mark":
            marks.append(int(value))
    return total, vcpus, marks


def run_counted(
    cpu: CpuClass,
    plugin: Path,
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    prefix: Path | None = None,
    timeout: float = 3600,
) -> Counted:
    """`cmd` under cpu's qemu with the counter; `prefix`: qemu's -L, the guest's root for an arm64 program
    (its loader, libraries and /proc/cpuinfo; paths not in it fall through to the host's)."""
    with tempfile.TemporaryDirectory(prefix="cpu-cost-") as tmp:
        out = Path(tmp) / "count.txt"
        argv = [cpu.qemu, "-cpu", cpu.qemu_cpu, "-plugin", f"{plugin},out={out}"]
        if prefix is not None:
            argv += ["-L", str(prefix)]
        if cpu.arch == "x86_64":
            env = {"GLIBC_TUNABLES": X86_COPY_LOOPS, **(env or {})}
        proc = subprocess.run(
            ["nice", "-n", "10", *argv, *cmd],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not out.exists():
            err = "\n".join(
                line
                for line in proc.stderr.splitlines()
                if "TCG doesn't support requested feature" not in line
            )
            raise RuntimeError(
                f"{' '.join(cmd[:3])}... exited {proc.returncode} under {cpu.qemu}: {err[-1500:]}"
            )
        total, vcpus, marks = parse(out.read_text())
    return Counted(total, vcpus, marks, proc.stdout.strip())


def phases(marks: list[int], prompt_tokens: int, decode: int) -> dict[str, float | int]:
    """The guests' markers (before the prefill, after it, after each decode step) as costs. Decode is the
    difference between the counts after N and after 2N steps, over N (the first N steps carry whatever
    the first calls set up, which the second N do not), with the first N's mean beside it."""
    if len(marks) != decode + 2 or decode < 2 or decode % 2:
        raise ValueError(f"expected {decode + 2} markers for {decode} decode steps (even), got {len(marks)}")
    half = decode // 2
    after_prefill = marks[1]
    steps = [b - a for a, b in itertools.pairwise(marks[1:])]
    return {
        "startup_insns": marks[0],
        "prefill_insns": after_prefill - marks[0],
        "insns_per_prompt_token": round((after_prefill - marks[0]) / prompt_tokens),
        "insns_per_decoded_token": round((marks[1 + decode] - marks[1 + half]) / half),
        "insns_per_decoded_token_first_half": round((marks[1 + half] - after_prefill) / half),
        "decode_step_min": min(steps),
        "decode_step_max": max(steps),
    }
