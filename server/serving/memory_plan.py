"""The memory planner: what a model costs resident, what the budget leaves free, and what to give up to load
another: batch rows first, then idle models. Pure functions plus one reading of the machine (MemoryBudget);
the pool acts on the plan.

A model's resident cost = its variant's weights + the KV buffers it keeps (full context cap, one per prefix
slot and one per batch row: the formula is models/runtime/session.py's, the only one) + the tokenizer + the
runtime around them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from governor.sensors import MemoryReading
from models.errors import InsufficientMemory
from models.runtime.session import KV_DTYPE, kv_bytes_per_token, kv_slot_count

log = logging.getLogger("simmer.memory")

MiB = 1 << 20
# onnxruntime's arenas and thread pool, the interpreter's share: what a loaded model costs besides its
# weights, KV cache and tokenizer (RSS of the server with the tiny model is ~120 MiB; we keep margin).
RUNTIME_BYTES = 128 * MiB
# A tokenizer.json parses into about three times its size (Gemma 3's 33 MB file holds ~100 MB loaded).
TOKENIZER_FACTOR = 3


def kv_rows(batch: int) -> int:
    """KV rows a batch decoder of up to `batch` replies holds: none for one reply at a time (the worker
    serves it through the engine's prefix slot, no batch decoder)."""
    return batch if batch > 1 else 0


@dataclass(frozen=True)
class Estimate:
    weights_bytes: int
    kv_bytes: int  # batch rows included
    tokenizer_bytes: int
    runtime_bytes: int = RUNTIME_BYTES
    rows: int = 0  # the batch decoder's KV rows counted in kv_bytes (kv_rows)
    row_bytes: int = 0  # one row's: a KV buffer of the whole context

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.tokenizer_bytes + self.runtime_bytes

    def with_rows(self, batch: int | None) -> Estimate:
        """The model serving at most `batch` replies at once (None: as configured); never more rows than
        configured."""
        if batch is None or kv_rows(batch) >= self.rows:
            return self
        rows = kv_rows(batch)
        return replace(self, kv_bytes=self.kv_bytes - (self.rows - rows) * self.row_bytes, rows=rows)

    def describe(self) -> str:
        return (
            f"{mib(self.total)} (weights {mib(self.weights_bytes)}, KV {mib(self.kv_bytes)}, "
            f"tokenizer {mib(self.tokenizer_bytes)}, runtime {mib(self.runtime_bytes)})"
        )


def mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / MiB:.0f} MiB"


def kv_per_token(manifest: Mapping[str, Any], variant: str | None = None) -> int:
    """KV bytes per token of context for `variant`, from the architecture and the KV type its conversion
    chose (an fp16 cache halves it; a variant that does not say is fp32), or the manifest's own number
    for folders that give no shape."""
    arch = manifest.get("architecture") or {}
    entry = (manifest.get("variants") or {}).get(variant) or {}
    try:
        return kv_bytes_per_token(
            int(arch["n_layers"]),
            int(arch["n_kv_heads"]),
            int(arch["head_dim"]),
            str(entry.get("kv_dtype") or KV_DTYPE.name),
        )
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
    per_token = kv_per_token(manifest, variant)
    slots = kv_slot_count(ctx, per_token, prefix_slots, prefix_budget_bytes) + batch_rows
    files = manifest.get("files") or {}
    tokenizer = int((files.get("tokenizer.json") or {}).get("size") or 0) * TOKENIZER_FACTOR
    return Estimate(weights, per_token * ctx * slots, tokenizer, rows=batch_rows, row_bytes=per_token * ctx)


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
    rows: int = 0  # its batch decoder's KV rows counted in bytes (Estimate.rows)
    row_bytes: int = 0

    def with_rows(self, batch: int) -> int:
        """Its bytes serving at most `batch` replies at once."""
        return self.bytes - max(0, self.rows - kv_rows(batch)) * self.row_bytes


@dataclass(frozen=True)
class LoadPlan:
    evict: tuple[str, ...]  # least recently used first
    need_bytes: int
    free_bytes: int | None  # before evicting
    rows: int | None = None  # the batch size every model serves from now (None: unchanged)


# The rule table for loading one model (decide first, act after: a refusal unloads nothing). `need` and
# the residents are at the batch size served now; fewer rows is a batch of fewer replies (new requests wait
# in the queue for a row), which costs throughput, not a model:
#
#   free unknown (no budget, no reading)                -> load, unload nothing
#   need <= free                                        -> load, unload nothing
#   need at b rows <= free + what idle models' rows     -> the largest such b (down to one reply at a
#     beyond b give back                                   time): serve batches of b, then load
#   need at one reply at a time <= free + the idle      -> one reply at a time, then unload idle models,
#     models' estimates                                    least recently used first, until it fits; load
#   otherwise                                           -> refuse: insufficient_memory with the numbers
# A busy model's rows are not counted: its running batch holds them until it ends.
def plan_load(
    model_id: str, need: Estimate, free_bytes: int | None, loaded: Sequence[Resident], *, budget: str = ""
) -> LoadPlan:
    if free_bytes is None or need.total <= free_bytes:
        return LoadPlan((), need.total, free_bytes)
    idle = sorted((r for r in loaded if not r.busy), key=lambda r: r.last_used)
    for batch in range(need.rows - 1, 0, -1):
        fewer = need.with_rows(batch).total
        if fewer <= free_bytes + sum(r.bytes - r.with_rows(batch) for r in idle):
            return LoadPlan((), fewer, free_bytes, rows=batch)
    one = need.with_rows(1).total
    rows = 1 if need.rows or any(r.rows for r in idle) else None
    evict: list[str] = []
    room = free_bytes + sum(r.bytes - r.with_rows(1) for r in idle)
    for resident in idle:
        evict.append(resident.model_id)
        room += resident.with_rows(1)
        if one <= room:
            return LoadPlan(tuple(evict), one, free_bytes, rows=rows)
    busy = [r for r in loaded if r.busy]
    held = "; in use: " + ", ".join(f"{r.model_id} ~{mib(r.bytes)}" for r in busy) if busy else ""
    idle_bytes = sum(r.bytes for r in idle)
    alone = " serving one reply at a time" if need.rows else ""
    raise InsufficientMemory(
        f"Not enough memory to load {model_id}: it needs ~{need.with_rows(1).describe()}{alone}, and "
        f"{budget or 'the budget'} leaves {mib(max(free_bytes, 0))} free ({mib(idle_bytes)} more if every "
        f"idle model were unloaded{held}). Nothing was unloaded. Free memory, lower SIMMER_CONTEXT_LENGTH or "
        "SIMMER_PREFIX_CACHE_MB, or raise SIMMER_MEMORY_BUDGET_MB.",
        needed_bytes=one,
        free_bytes=free_bytes,
        idle_bytes=idle_bytes,
    )
