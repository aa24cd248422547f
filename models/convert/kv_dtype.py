"""The KV cache's element type a conversion chooses for the CPU it runs on (a pull converts on the device).

An fp16 cache halves the KV memory (SmolLM2 135M: 23 KB a token of context instead of 46). The graph then
runs GroupQueryAttention all in fp16 between casts (models/convert/block.py): onnxruntime's fp16 kernel.
Counted on an emulated Cortex-A76 (fp16 arithmetic) it costs fewer instructions than the fp32 attention,
where onnxruntime's fp32 attention over an fp16 cache cost more (docs/arm64.md, "An fp16 KV cache"). x86
keeps fp32: there `q4-a8` is the nominal variant within the quality floor, and with the fp16 attention its
KL on SmolLM2 (0.00340) is above llama.cpp's (0.00313), for 0.92x the decode instructions (AVX2, counted).
"""

from __future__ import annotations

import platform
from pathlib import Path

FP32, FP16 = "float32", "float16"
ARM64_MACHINES = frozenset({"aarch64", "arm64"})
# the two Features of /proc/cpuinfo that say a core computes in fp16: scalar (fphp) and SIMD (asimdhp)
FP16_FEATURES = frozenset({"fphp", "asimdhp"})


def cpu_features(cpuinfo: str) -> frozenset[str]:
    """The features every core lists in /proc/cpuinfo (a big.LITTLE kernel lists each core; a feature only
    some cores have is not one a thread can count on)."""
    sets = [
        frozenset(line.split(":", 1)[1].split())
        for line in cpuinfo.splitlines()
        if line.split(":", 1)[0].strip() == "Features" and ":" in line
    ]
    return frozenset.intersection(*sets) if sets else frozenset()


# | machine            | every core has fphp and asimdhp | KV cache |
# |--------------------|---------------------------------|----------|
# | aarch64 / arm64    | yes                             | float16  |
# | aarch64 / arm64    | no (Cortex-A72, A53)            | float32  |
# | any other (x86_64) | -                               | float32  |
def kv_dtype_for(machine: str, cpuinfo: str) -> str:
    """The KV type of a conversion on this machine (`platform.machine()`, /proc/cpuinfo's text)."""
    if machine.lower() not in ARM64_MACHINES:
        return FP32
    return FP16 if cpu_features(cpuinfo) >= FP16_FEATURES else FP32


INT8_ACTIVATIONS = 4  # MatMulNBits' accuracy_level of the variants with int8 activations (VariantSpec)


# | the variant's activations         | this CPU's KV type | the variant's KV type |
# |-----------------------------------|--------------------|-----------------------|
# | fp32 (f32, q4: the exact ones)    | any                | float32               |
# | int8 (q8, q4-a8, fast)            | float16            | float16               |
# | int8                              | float32            | float32               |
def variant_kv_dtype(cpu_kv_dtype: str, accuracy_level: int) -> str:
    """A variant's KV type: an exact variant stays the fp32 reference's to the rounding (its promise), a
    variant with int8 activations takes the CPU's choice (its activations' rounding is far coarser than
    an fp16 key's, and llama.cpp's CPU cache, the quality floor, is fp16 too)."""
    return cpu_kv_dtype if accuracy_level == INT8_ACTIVATIONS else FP32


# Counted on an emulated Cortex-A76 (docs/arm64.md), SmolLM2 q4-a8 at 270 positions: the fp16 attention
# 0.82x the fp32 one's instructions per decoded token, 0.93x per prompt token (fp32 attention over an fp16
# cache: 1.32x). Where kv_dtype_for says a core can, a conversion takes the half cache by default.
HALF_KV_DEFAULT = True


def kv_dtype_here(
    cpuinfo: Path = Path("/proc/cpuinfo"), machine: str | None = None, half_kv: bool = HALF_KV_DEFAULT
) -> str:
    """The KV type a conversion on this machine gets by default: kv_dtype_for it where `half_kv`, else
    fp32 (HALF_KV_DEFAULT); fp32 where /proc/cpuinfo cannot be read."""
    if not half_kv:
        return FP32
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    return kv_dtype_for(machine or platform.machine(), text)
