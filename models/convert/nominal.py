"""Which variant a model opens on (the manifest's `default_variant`) and which variants a pull keeps: the one
rule, from the quality measured on the machine that converts the model.

**The floor** is the quality llama.cpp gets from the same GGUF, measured at pull time as KL divergence from
the fp32 reference over the quality text (mean and p99, models/convert/quality.py):
- llama.cpp's own KL on the same GGUF and token ids, when llama-cpp-python is installed;
- else the int8 reference's: the fp32 forward with every matmul input rounded as llama.cpp's CPU matmul rounds
  it for that weight's type (ReferenceForward with `int8_activations`: int8 per 32-block beside Q4_0..Q8_0,
  per 256-block beside the K-quants, half precision beside F16), llama.cpp's arithmetic computed exactly in
  numpy, on any machine. Over the 512-token text it measured llama.cpp's KL within 4 % on the mean on
  SmolLM2 Q4_1, Gemma 3 270M, Qwen2.5-Coder 0.5B and 1.5B Q4_K_M (1.5B: the same one outlying position),
  and within 0.82-1.24x on the p99. It is taken as it is, with no allowance: the first allowance (1.5x an
  int8 reference that rounded every input per 32-block) let through SmolLM2's `q4-a8`, 1.24x llama.cpp's
  KL, whose greedy answer to "What is the capital of France?" was wrong where the exact `q4`'s was right, and
  a pull's choice must not depend on whether a test-only peer is installed.

**The candidates** are `q4-a8` (the GGUF's blocks, int8 activations) and `fast` (re-encoded for fewer bytes
per token; installed only within the floor, refused otherwise: pipeline.build_reencoded). A candidate is
within the floor when its KL mean and its KL p99 are both at most the floor's. The nominal variant is the
candidate within it that decoded with the fewest CPU-seconds per token at pull time (the candidates timed
again in alternation: pipeline.race; a tie goes to q4-a8). When none is within it, the exact `q4` (the GGUF's
blocks, fp32 activations) is nominal, built for the purpose if the pull had not asked for it, and the fastest
candidate stays beside it as the ladder's cheaper rung. Nothing measured (a conversion without measuring):
q4-a8.

**What a pull keeps**: with no variants named, the nominal variant alone (and that rung when the nominal one
is q4): the others would be disk the device never reads. Variants named (`simmer pull --variants`,
SIMMER_VARIANT, SIMMER_LADDER) are kept beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from models.types import NOMINAL_VARIANT

REENCODED = "fast"
EXACT = "q4"
CANDIDATES = (NOMINAL_VARIANT, REENCODED)


def peer_floor(peer_quality: Mapping[str, Any]) -> dict[str, Any]:
    """The floor from llama.cpp's own measurement (a quality.Comparison summary)."""
    return {"source": "llama.cpp", **dict(peer_quality)}


def int8_floor(int8_quality: Mapping[str, Any]) -> dict[str, Any]:
    """The floor from the int8 reference's measurement (a quality.Comparison summary): llama.cpp's
    arithmetic on this file, computed without llama.cpp."""
    return {
        **dict(int8_quality),
        "source": "int8 reference",
        "method": "llama.cpp's arithmetic computed in numpy (each matmul input rounded as llama.cpp's CPU "
        f"matmul rounds it for the weight's type): {int8_quality.get('method', '')}",
    }


def check(quality: Mapping[str, Any] | None, floor: Mapping[str, Any]) -> str | None:
    """None when a variant's measured quality is within the floor, else why it is not (for the log and the
    manifest). A variant that was not measured is never within it."""
    if not quality or "kl_mean" not in quality or "kl_p99" not in quality:
        return "its KL against the fp32 reference was not measured"
    who = (
        "llama.cpp's on the same GGUF"
        if floor.get("source") == "llama.cpp"
        else "the int8 reference's, llama.cpp's arithmetic on this file"
    )
    over = [
        f"KL {stat} {float(quality[key]):.3g} > {float(floor[key]):.3g}"
        for stat, key in (("mean", "kl_mean"), ("p99", "kl_p99"))
        if float(quality[key]) > float(floor[key])
    ]
    return f"{', '.join(over)} ({who})" if over else None


def candidates(planned: Sequence[str], measure: bool) -> list[str]:
    """The candidates a pull builds for a source whose variants are `planned` (pipeline.plan_variants): the
    re-encoded one only when its quality can be measured (it is never installed unmeasured)."""
    return [n for n in CANDIDATES if n in planned and (measure or n != REENCODED)]


def _cpu(entry: Mapping[str, Any]) -> float | None:
    value = (entry.get("speed") or {}).get("cpu_s_per_token")
    return float(value) if isinstance(value, int | float) else None


def _fastest(names: Sequence[str], entries: Mapping[str, Mapping[str, Any]]) -> str:
    timed = [n for n in names if _cpu(entries[n]) is not None]
    return min(timed, key=lambda n: _cpu(entries[n]) or 0.0) if timed else names[0]


def choose(
    installed: Sequence[str], entries: Mapping[str, Mapping[str, Any]], floor: Mapping[str, Any] | None
) -> tuple[str, str]:
    """(the nominal variant among those `installed`, why), from their manifest entries and the floor."""
    present = [n for n in CANDIDATES if n in installed]
    if not present:
        return installed[-1], f"no {NOMINAL_VARIANT} or {REENCODED}: the source's last variant"
    if floor is None:
        return present[0], "quality not measured"
    within = [n for n in present if check(entries[n].get("quality"), floor) is None]
    if within:
        name = _fastest(within, entries)
        return name, f"{name}: within the floor, the fastest measured of {', '.join(within)}"
    reasons = "; ".join(f"{n} {check(entries[n].get('quality'), floor)}" for n in present)
    if EXACT in installed:
        return EXACT, f"no candidate within the floor ({reasons}): the exact {EXACT}"
    return _fastest(present, entries), f"no candidate within the floor ({reasons}) and no {EXACT}"


def needs_exact(installed: Sequence[str], entries: Mapping[str, Mapping[str, Any]], floor: Any) -> bool:
    """Whether the rule falls back on the exact variant and it is not built yet."""
    present = [n for n in CANDIDATES if n in installed]
    return (
        floor is not None
        and bool(present)
        and EXACT not in installed
        and all(check(entries[n].get("quality"), floor) is not None for n in present)
    )


def kept(
    installed: Sequence[str],
    nominal: str,
    asked: Sequence[str] | None,
    entries: Mapping[str, Mapping[str, Any]],
) -> list[str]:
    """What a pull keeps: the variants asked for by name and the nominal one; with none asked, the nominal
    one, and beside an exact nominal the fastest candidate (the ladder's cheaper rung)."""
    if asked is not None:
        return [n for n in installed if n in asked or n == nominal]
    keep = {nominal}
    present = [n for n in CANDIDATES if n in installed]
    if nominal == EXACT and present:
        keep.add(_fastest(present, entries))
    return [n for n in installed if n in keep]
