"""Settings -> engine arguments, in one place: `simmer serve` (through the model pool), `run`, `chat` and the
benchmarks all open engines with an EngineConfig, so a setting means the same everywhere."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from governor.cgroup import usable_cpus
from models.errors import InvalidParameter
from models.protocol import EngineLimits
from models.runtime.engine import DecoderEngine
from server.settings import Settings


def engine_threads(settings: Settings, requested: int | None = None) -> int:
    """Requested threads, never above the CPUs this process may really use (affinity, cgroup quota)."""
    cpus = usable_cpus(settings.cgroup_root, settings.proc_root)
    return max(1, min(requested or settings.threads or cpus, cpus))


def chat_template_override(settings: Settings) -> str | None:
    """The text of SIMMER_CHAT_TEMPLATE's file (None: each model's own)."""
    path = settings.chat_template
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameter(f"SIMMER_CHAT_TEMPLATE: cannot read {path}: {e}", param="chat_template") from e


@dataclass(frozen=True)
class EngineConfig:
    home: Path
    threads: int  # capped at the usable CPUs
    context_length: int
    prefill_chunk: int
    spin: str
    prefix_slots: int
    prefix_budget_bytes: int
    chat_template: str | None  # SIMMER_CHAT_TEMPLATE's text, read once
    variant: str | None = None  # SIMMER_VARIANT: the variant a model opens on when it has it
    speculation: str = "auto"  # SIMMER_SPECULATION: prompt-lookup speculation
    window_reply_contexts: int = 1  # SIMMER_WINDOW_REPLY_CONTEXTS: a sliding-window reply's bound
    kv_prefault: bool = True  # SIMMER_KV_PREFAULT: a KV buffer resident when allocated (kv_zeros)
    max_batch: int = 1  # SIMMER_MAX_BATCH: replies of one model decoded together (1: one at a time)
    batch: str = "exact"  # SIMMER_BATCH: batch only where rows are alike (exact), or everywhere (fast)

    @property
    def batch_rows(self) -> int:
        """KV rows a model's batch decoder holds (none when replies run one at a time)."""
        return self.max_batch if self.max_batch > 1 else 0

    @classmethod
    def from_settings(cls, settings: Settings, *, threads: int | None = None) -> EngineConfig:
        return cls(
            home=settings.home,
            threads=engine_threads(settings, threads),
            context_length=settings.context_length,
            prefill_chunk=settings.prefill_chunk,
            spin=settings.spin,
            prefix_slots=settings.prefix_cache_slots,
            prefix_budget_bytes=settings.prefix_cache_mb << 20,
            chat_template=chat_template_override(settings),
            variant=settings.variant,
            speculation=settings.speculation,
            window_reply_contexts=settings.window_reply_contexts,
            kv_prefault=settings.kv_prefault,
            max_batch=settings.max_batch,
            batch=settings.batch,
        )

    def open(
        self,
        path: Path,
        manifest: dict[str, Any],
        *,
        model_id: str,
        variant: str | None = None,
        limits: EngineLimits | None = None,
    ) -> DecoderEngine:
        """A converted folder. `variant`, else SIMMER_VARIANT where the model has it, else its default.
        `limits`: the governor's, applied before the first session is built (one session, not two)."""
        variants = manifest.get("variants") or {}
        chosen = variant or (self.variant if self.variant in variants else None)
        return DecoderEngine(
            path,
            manifest,
            model_id=model_id,
            variant=chosen,
            threads=self.threads,
            context_length=self.context_length,
            prefill_chunk=self.prefill_chunk,
            spin=self.spin,
            prefix_slots=self.prefix_slots,
            prefix_budget_bytes=self.prefix_budget_bytes,
            chat_template=self.chat_template,
            speculation=self.speculation,
            window_reply_contexts=self.window_reply_contexts,
            kv_prefault=self.kv_prefault,
            batch=self.batch,
            limits=limits,
        )

    def open_dir(self, model_dir: Path, *, variant: str | None = None) -> DecoderEngine:
        """A folder with its manifest.json (the benchmarks' --model-dir)."""
        manifest = json.loads((Path(model_dir) / "manifest.json").read_text())
        model_id = str(manifest.get("id") or Path(model_dir).name)
        return self.open(Path(model_dir), manifest, model_id=model_id, variant=variant)

    def open_installed(
        self, model: str, *, variant: str | None = None, limits: EngineLimits | None = None
    ) -> DecoderEngine:
        """An installed model, as the store serves it (a version whose files changed falls back)."""
        from models.store.store import ModelStore

        installed = ModelStore(self.home).load(model)
        return self.open(
            installed.path, installed.manifest, model_id=installed.id, variant=variant, limits=limits
        )
