"""Settings -> the ModelChoice (serving/model_choice.py) and what it holds: the catalog of a store, of
converted folders or of one engine, the pool that loads from it, the governor's ladder across it with its
start rung (the memory tier), and the default model.

`serve_store` is `simmer serve`'s; `serve_folders` serves converted folders (benchmarks, tests);
`serve_single` one engine handed over ready or by a factory (tests, older callers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from governor.limits import Rung
from governor.policy import PolicyConfig
from governor.sensors import read_memory
from models.errors import WrongModelKind
from models.protocol import Engine, EngineLimits
from models.types import KIND_GENERATION
from server.serving.catalog import Catalog, CatalogEntry, FolderCatalog, SingleCatalog, StoreCatalog
from server.serving.engine_config import EngineConfig
from server.serving.ladder import build_ladder, describe, model_rungs, parse_ladder, pick_start, place
from server.serving.memory_plan import Estimate, MemoryBudget, estimate
from server.serving.model_choice import ModelChoice
from server.serving.model_pool import ModelPool, Opener
from server.serving.tokenizers import Tokenizers
from server.settings import Settings

log = logging.getLogger("simmer.governor")


def default_model(settings: Settings) -> str:
    """SIMMER_MODEL; when only SIMMER_LADDER is set, the ladder's first model."""
    spec = parse_ladder(settings.ladder)
    if spec and "model" not in settings.model_fields_set:
        return spec[0][0]
    return settings.model


def memory_budget(settings: Settings) -> MemoryBudget:
    return MemoryBudget(
        explicit_bytes=None if settings.memory_budget_mb is None else settings.memory_budget_mb << 20,
        reserve_bytes=settings.memory_reserve_mb << 20,
        read=lambda: read_memory(settings.cgroup_root, settings.proc_root),
    )


def cost_function(config: EngineConfig) -> Callable[[CatalogEntry, str | None], Estimate]:
    def cost(entry: CatalogEntry, variant: str | None) -> Estimate:
        return estimate(
            entry.manifest,
            variant or entry.default_variant,
            context_length=config.context_length,
            prefix_slots=config.prefix_slots,
            prefix_budget_bytes=config.prefix_budget_bytes,
            batch_rows=config.batch_rows,
        )

    return cost


def _assemble(
    settings: Settings,
    catalog: Catalog,
    opener: Opener,
    config: EngineConfig,
    budget: MemoryBudget,
) -> ModelChoice:
    cost = cost_function(config)
    pool = ModelPool(catalog, opener, cost, budget, keep_alive_s=keep_alive_default(settings))
    model = default_model(settings)
    default = catalog.get(model)
    if default is not None and default.kind != KIND_GENERATION:
        # the worker preloads the default model as a generative engine; an encoder is opened per request
        raise WrongModelKind(
            f"SIMMER_MODEL names '{model}', an embedding model: the default model must generate. Serve a "
            "generative model and name the embedding model in embeddings requests",
            param="model",
        )
    spec = parse_ladder(settings.ladder)
    if spec:
        ladder = build_ladder(spec, catalog, preferred_variant=settings.variant)
    else:
        entry = catalog.get(model)
        ladder = model_rungs(entry, settings.variant) if entry is not None else []
    choice = ModelChoice(
        catalog,
        pool,
        model,
        ladder,
        cost=cost,
        context_cap=config.context_length,
        tokenizers=Tokenizers(config.chat_template),
    )
    if ladder:
        # headroom: what keeps the governor's memory level nominal once the model is in (its fair threshold)
        reading = budget.read() if budget.explicit_bytes is None else None
        total = budget.explicit_bytes or (reading.limit_bytes if reading else 0)
        headroom = max(budget.reserve_bytes, int(PolicyConfig().memory_fair_fraction * total))
        free = budget.free(0)
        choice.start = pick_start(ladder, lambda r: cost(_entry(catalog, r), r.variant), free, headroom)
        log.info("memory tier: %s; ladder %s", choice.start.describe(ladder), describe(ladder))
        start = ladder[choice.start.index]
        choice.preload = place(ladder, (start.model_id, start.variant), model, lambda _: True).model_id
    else:
        choice.preload = model
    return choice


def _entry(catalog: Catalog, rung: Rung) -> CatalogEntry:
    entry = catalog.get(rung.model_id)
    assert entry is not None  # build_ladder checked every rung
    return entry


def keep_alive_default(settings: Settings) -> float:
    """SIMMER_KEEP_ALIVE_S with Ollama's meaning: negative keeps, 0 unloads after each reply."""
    return float("inf") if settings.keep_alive_s < 0 else settings.keep_alive_s


def serve_store(settings: Settings, config: EngineConfig | None = None) -> ModelChoice:
    config = config or EngineConfig.from_settings(settings)
    catalog = StoreCatalog(settings.home, chat_override=config.chat_template is not None)
    cleaned = catalog.store.sweep()  # what an install killed mid-way (SIGTERM) left in the store
    if cleaned:
        logging.getLogger("simmer.store").info("removed what killed installs left of %s", ", ".join(cleaned))

    def opener(entry: CatalogEntry, variant: str | None, limits: EngineLimits | None) -> Engine:
        return config.open_installed(entry.id, variant=variant, limits=limits)

    return _assemble(settings, catalog, opener, config, memory_budget(settings))


def serve_folders(settings: Settings, folders: list[Path], config: EngineConfig | None = None) -> ModelChoice:
    config = config or EngineConfig.from_settings(settings)
    catalog = FolderCatalog(folders, chat_override=config.chat_template is not None)

    def opener(entry: CatalogEntry, variant: str | None, limits: EngineLimits | None) -> Engine:
        assert entry.path is not None
        return config.open(
            entry.path, dict(entry.manifest), model_id=entry.id, variant=variant, limits=limits
        )

    if catalog.get(settings.model) is None and not settings.ladder and catalog.entries():
        settings = settings.model_copy(update={"model": catalog.entries()[0].id})
    return _assemble(settings, catalog, opener, config, memory_budget(settings))


def serve_single(settings: Settings, load: Callable[[], Engine]) -> ModelChoice:
    """One engine (tests, a factory): pinned in the pool; unloading frees its sessions, not the object."""
    catalog = SingleCatalog(settings.model)

    def opener(entry: CatalogEntry, variant: str | None, limits: EngineLimits | None) -> Engine:
        engine = load()  # built already, or by a factory that knows no limits
        catalog.know(engine)
        return engine

    pool = ModelPool(
        catalog,
        opener,
        lambda entry, variant: Estimate(0, 0, 0, 0),
        keep_alive_s=keep_alive_default(settings),
        pinned=True,
    )
    return ModelChoice(catalog, pool, settings.model, preload=settings.model)
