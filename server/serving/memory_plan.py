"""The memory planner: what a model costs resident, what the budget leaves free, and what to unload to load
another. Pure functions plus one reading of the machine (MemoryBudget); the pool acts on the plan.

A model's resident cost = its variant's weights + the KV buffers it keeps (full context cap, one per prefix
slot: the formula is models/runtime/session.py's, the only one) + the tokenizer + the runtime around them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from governor.sensors import MemoryReading
from models.errors import InsufficientMemory
from models.runtime.session import kv_bytes_per_token, kv_slot_count

log = logging.getLogger("simmer.memory")

MiB = 1 << 20
# onnxruntime's arenas and thread pool, the interpreter's share: what a loaded model costs besides its
# weights, KV cache and tokenizer (RSS of the server with the tiny model is ~120 MiB; we keep margin).
RUNTIME_BYTES = 128 * MiB
# A tokenizer.json parses into about three times its size (Gemma 3's 33 MB file holds ~100 MB loaded).
TOKENIZER_FACTOR = 3


@dataclass(frozen=True)
class Estimate:
    weights_bytes: int
    kv_bytes: int
    tokenizer_bytes: int
    runtime_bytes: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.tokenizer_bytes + self.runtime_bytes

    def describe(self) -> str:
        return (
            f"{mib(self.total)} (weights {mib(self.weights_bytes)}, KV {mib(self.kv_bytes)}, "
            f"tokenizer {mib(self.tokenizer_bytes)}, runtime {mib(self.runtime_bytes)})"
        )


def mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / MiB:.0f} MiB"


def kv_per_token(manifest: Mapping[str, Any]) -> int:
    """KV bytes per token of context, from the architecture (the manifest's own number for folders that
    give no shape)."""
    arch = manifest.get("architecture") or {}
    try:
        return kv_bytes_per_token(int(arch["n_layers"]), int(arch["n_kv_heads"]), int(arch["head_dim"]))
    except (KeyError, TypeError, ValueError):
        value = manifest.get("kv_bytes_per_token")
        return int(value) if isinstance(value, int) else 0


def estimate(
    manifest: Mapping[str, Any],
    variant: str | None,
    *,
    context_length: int,
    prefix_slots: int,
    prefix_budget_bytes: int,
    batch_rows: int = 0,
) -> Estimate:
    """What `variant` of this model holds once loaded and used at the context cap. `batch_rows`: the rows
    of its batch decoder (replies served at once), each a KV buffer of the whole context, held beside the
    prefix-reuse slots (a reply outside a batch, a summary, uses those)."""
    variants = manifest.get("variants") or {}
    entry = variants.get(variant) or {}
    weights = entry.get("weights_bytes")
    if not isinstance(weights, int):
        weights = int((entry.get("memory") or {}).get("total_bytes") or 0)
    ctx = min(context_length, int(manifest.get("context_length") or context_length))
    per_token = kv_per_token(manifest)
    slots = kv_slot_count(ctx, per_token, prefix_slots, prefix_budget_bytes) + batch_rows
    files = manifest.get("files") or {}
    tokenizer = int((files.get("tokenizer.json") or {}).get("size") or 0) * TOKENIZER_FACTOR
    return Estimate(weights, per_token * ctx * slots, tokenizer)


# -- the budget ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBudget:
    """How much more the server may take. With an explicit budget (SIMMER_MEMORY_BUDGET_MB), what the loaded
    models' estimates leave of it; else what the cgroup (or the host) has available now, minus a reserve
    for everything else on the device."""

    explicit_bytes: int | None
    reserve_bytes: int
    read: Callable[[], MemoryReading | None] = lambda: None

    def free(self, loaded_bytes: int) -> int | None:
        """Bytes a new model may take now (None: unknown, no limit known)."""
        if self.explicit_bytes is not None:
            return self.explicit_bytes - loaded_bytes
        reading = self.read()
        if reading is None:
            return None
        return reading.available_bytes - self.reserve_bytes

    def describe(self) -> str:
        if self.explicit_bytes is not None:
            return f"the budget of {mib(self.explicit_bytes)} (SIMMER_MEMORY_BUDGET_MB)"
        reading = self.read()
        where = reading.source if reading else "unknown"
        return f"available memory ({where}) minus a reserve of {mib(self.reserve_bytes)}"


# -- one load ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resident:
    """A loaded model as the planner sees it."""

    model_id: str
    bytes: int
    last_used: float
    busy: bool = False  # serving right now (or pinned): never unloaded to make room


@dataclass(frozen=True)
class LoadPlan:
    evict: tuple[str, ...]  # least recently used first
    need_bytes: int
    free_bytes: int | None  # before evicting


# The rule table for loading one model (decide first, act after: a refusal unloads nothing):
#
#   free unknown (no budget, no reading)                -> load, unload nothing
#   need <= free                                        -> load, unload nothing
#   need <= free + the idle models' estimates           -> unload idle models, least recently used first,
#                                                          until it fits; then load
#   otherwise                                           -> refuse: insufficient_memory with the numbers
def plan_load(
    model_id: str, need: Estimate, free_bytes: int | None, loaded: Sequence[Resident], *, budget: str = ""
) -> LoadPlan:
    if free_bytes is None or need.total <= free_bytes:
        return LoadPlan((), need.total, free_bytes)
    evict: list[str] = []
    room = free_bytes
    for resident in sorted((r for r in loaded if not r.busy), key=lambda r: r.last_used):
        evict.append(resident.model_id)
        room += resident.bytes
        if need.total <= room:
            return LoadPlan(tuple(evict), need.total, free_bytes)
    busy = [r for r in loaded if r.busy]
    held = "; in use: " + ", ".join(f"{r.model_id} ~{mib(r.bytes)}" for r in busy) if busy else ""
    idle = sum(r.bytes for r in loaded if not r.busy)
    raise InsufficientMemory(
        f"Not enough memory to load {model_id}: it needs ~{need.describe()}, and {budget or 'the budget'} "
        f"leaves {mib(max(free_bytes, 0))} free ({mib(idle)} more if every idle model were unloaded{held}). "
        "Nothing was unloaded. Free memory, lower SIMMER_CONTEXT_LENGTH or SIMMER_PREFIX_CACHE_MB, or raise "
        "SIMMER_MEMORY_BUDGET_MB.",
        needed_bytes=need.total,
        free_bytes=free_bytes,
        idle_bytes=idle,
    )
