"""The KV type a conversion chooses: per CPU (kv_dtype_for, from /proc/cpuinfo) and per variant
(variant_kv_dtype), each tested against its rule table (models/convert/kv_dtype.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.convert.kv_dtype import FP16, FP32, cpu_features, kv_dtype_for, kv_dtype_here, variant_kv_dtype

CPUINFO = Path(__file__).resolve().parents[2] / "arm64" / "cpuinfo"  # the emulated cores' (tests/arm64)


def board(core: str, cpus: int = 4, first: int = 0) -> str:
    """A /proc/cpuinfo of `cpus` identical cores from `first` on, as the kernel writes it
    (tests/arm64/cpuinfo.sh)."""
    block = (CPUINFO / f"{core}.txt").read_text()
    return "\n".join(f"processor\t: {i}\n{block}" for i in range(first, first + cpus))


X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni f16c\n"
# a big.LITTLE phone whose little cores lack the fp16 features: no thread can count on them
MIXED = board("cortex-a76", 2) + "\n" + board("cortex-a72", 2, first=2)


# | machine            | every core has fphp and asimdhp | KV cache |
# |--------------------|---------------------------------|----------|
# | aarch64 / arm64    | yes                             | float16  |
# | aarch64 / arm64    | no (Cortex-A72, A53)            | float32  |
# | any other (x86_64) | -                               | float32  |
@pytest.mark.parametrize(
    ("machine", "cpuinfo", "want"),
    [
        ("aarch64", board("cortex-a76"), FP16),  # Raspberry Pi 5, most phones since 2018
        ("arm64", board("max"), FP16),  # qemu's max: a Neoverse-N2
        ("aarch64", board("cortex-a72"), FP32),  # Raspberry Pi 4: no fp16 arithmetic
        ("aarch64", MIXED, FP32),
        ("aarch64", "", FP32),  # unreadable: nothing promised
        ("aarch64", "Features\t: fp asimd fphp\n", FP32),  # scalar fp16 alone: no SIMD kernels
        ("x86_64", X86, FP32),
        ("x86_64", board("cortex-a76"), FP32),  # qemu-user shows a guest's file to the host's machine
    ],
)
def test_kv_dtype_for_when_machine_and_features_then_the_table(machine, cpuinfo, want) -> None:
    assert kv_dtype_for(machine, cpuinfo) == want


def test_cpu_features_when_cores_differ_then_only_what_every_core_has() -> None:
    assert {"fphp", "asimdhp", "asimddp"} <= cpu_features(board("cortex-a76"))
    assert "fphp" not in cpu_features(MIXED)
    assert "asimd" in cpu_features(MIXED)


def test_kv_dtype_here_when_cpuinfo_missing_then_fp32(tmp_path) -> None:
    assert kv_dtype_here(tmp_path / "no-cpuinfo", "aarch64", half_kv=True) == FP32


def test_kv_dtype_here_when_a76_then_half_by_default_and_x86_never(tmp_path) -> None:
    (tmp_path / "cpuinfo").write_text(board("cortex-a76"))
    assert kv_dtype_here(tmp_path / "cpuinfo", "aarch64", half_kv=True) == FP16
    assert kv_dtype_here(tmp_path / "cpuinfo", "aarch64", half_kv=False) == FP32
    # the default: counted fewer instructions than fp32 on this core (docs/arm64.md)
    assert kv_dtype_here(tmp_path / "cpuinfo", "aarch64") == FP16
    assert kv_dtype_here(tmp_path / "cpuinfo", "x86_64") == FP32


# | the variant's activations         | this CPU's KV type | the variant's KV type |
# |-----------------------------------|--------------------|-----------------------|
# | fp32 (f32, q4: the exact ones)    | any                | float32               |
# | int8 (q8, q4-a8, fast)            | float16            | float16               |
# | int8                              | float32            | float32               |
@pytest.mark.parametrize(
    ("cpu", "accuracy_level", "want"),
    [(FP16, 1, FP32), (FP32, 1, FP32), (FP16, 4, FP16), (FP32, 4, FP32)],
)
def test_variant_kv_dtype_when_activations_and_cpu_then_the_table(cpu, accuracy_level, want) -> None:
    assert variant_kv_dtype(cpu, accuracy_level) == want
