"""Settings -> a loaded engine. The one place that turns configuration into engine arguments."""

from __future__ import annotations

from pathlib import Path

from governor.cgroup import usable_cpus
from models.errors import InvalidParameter
from models.runtime.engine import LlamaEngine
from models.store.store import ModelStore
from server.settings import Settings


def engine_threads(settings: Settings, requested: int | None = None) -> int:
    """Requested threads, never above the CPUs this process may really use (affinity, cgroup quota)."""
    cpus = usable_cpus(settings.cgroup_root, settings.proc_root)
    return max(1, min(requested or settings.threads or cpus, cpus))


def chat_template_override(settings: Settings) -> str | None:
    """The text of SIMMER_CHAT_TEMPLATE's file, read when the engine loads (None: the model's own)."""
    path = settings.chat_template
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameter(f"SIMMER_CHAT_TEMPLATE: cannot read {path}: {e}", param="chat_template") from e


def open_engine(
    settings: Settings, *, model: str | None = None, variant: str | None = None, threads: int | None = None
) -> LlamaEngine:
    installed = ModelStore(settings.home).load(model or settings.model)
    return LlamaEngine(
        installed.path,
        installed.manifest,
        model_id=installed.id,
        variant=variant or settings.variant,
        threads=engine_threads(settings, threads),
        context_length=settings.context_length,
        prefill_chunk=settings.prefill_chunk,
        spin=settings.spin,
        prefix_slots=settings.prefix_cache_slots,
        prefix_budget_bytes=settings.prefix_cache_mb << 20,
        chat_template=chat_template_override(settings),
    )
