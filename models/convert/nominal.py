"""Which variant a model opens on (the manifest's `default_variant`), and which variants a pull keeps.

The nominal variant's candidates are `q4-a8` (the GGUF's own blocks, int8 activations) and `fast` (re-encoded
for the cheapest kernels, built only where the floor can be measured and installed only within it:
models/convert/floor.py). Of the candidates installed, the nominal one is the one that decoded with the
fewest CPU-seconds per token on this machine at pull time (timed in alternation: pipeline.race), since
every candidate left is within the quality floor. Nothing measured: q4-a8.

A pull that names no variants builds every candidate the source allows and keeps only the nominal one
(the device serves it; the others would be disk it never reads). Variants named (`simmer pull --variants`,
SIMMER_VARIANT, SIMMER_LADDER) are kept beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from models.types import NOMINAL_VARIANT

REENCODED = "fast"
CANDIDATES = (NOMINAL_VARIANT, REENCODED)


def candidates(planned: Sequence[str], measure: bool) -> list[str]:
    """The candidates a pull builds for a source whose variants are `planned` (pipeline.plan_variants): a
    re-encoded one only when its quality can be measured (it is never installed unmeasured)."""
    return [n for n in CANDIDATES if n in planned and (measure or n != REENCODED)]


def choose(installed: Sequence[str], entries: Mapping[str, Mapping[str, Any]]) -> str:
    """The nominal variant among those `installed` (each within the floor), from their manifest entries."""
    timed = [n for n in CANDIDATES if n in installed and "cpu_s_per_token" in (entries[n].get("speed") or {})]
    if timed:
        return min(timed, key=lambda n: entries[n]["speed"]["cpu_s_per_token"])
    return next((n for n in CANDIDATES if n in installed), installed[-1])


def kept(installed: Sequence[str], nominal: str, asked: Sequence[str] | None) -> list[str]:
    """What a pull keeps: the variants asked for by name, and the nominal one."""
    if asked is None:
        return [nominal]
    return [n for n in installed if n in asked or n == nominal]
