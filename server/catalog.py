"""What can be served: every installed model, as facts read from its manifest without loading it.

The server lists these in /v1/models, routes requests by their exact ids, builds the governor's ladder
from them and plans memory with them. Three sources:
- `StoreCatalog`: the model store (`simmer serve`); re-read at most every REFRESH_S, so a model pulled while
  the server runs becomes servable without a restart;
- `FolderCatalog`: converted folders named by id (the benchmarks' --model-dir, tests);
- `SingleCatalog`: one engine handed over ready (or by a factory), known by its id once loaded.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from models.errors import SimmerError
from models.runtime.engine import nominal_variant, variant_order
from models.runtime.tokenizer import TOKENIZER_CONFIG, tokenizer_key

log = logging.getLogger("simmer.server")

REFRESH_S = 2.0


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    path: Path | None  # the model folder (None: an engine handed over ready)
    manifest: Mapping[str, Any]
    can_chat: bool  # a chat template: the model's own, or SIMMER_CHAT_TEMPLATE's
    tokenizer_key: str
    disk_bytes: int | None = None
    vocab_size: int | None = None  # token ids are 0..vocab_size-1 (None: not known before it loads)

    @property
    def variants(self) -> list[str]:
        """Installed variants, best quality first."""
        return variant_order(dict(self.manifest))

    @property
    def default_variant(self) -> str | None:
        return nominal_variant(dict(self.manifest))

    @property
    def context_length(self) -> int | None:
        value = self.manifest.get("context_length") or (self.manifest.get("architecture") or {}).get(
            "context_length"
        )
        return int(value) if value else None


class Catalog(Protocol):
    def entries(self) -> list[CatalogEntry]: ...
    def get(self, model_id: str) -> CatalogEntry | None: ...


def entry_from_folder(
    model_id: str,
    path: Path,
    manifest: Mapping[str, Any],
    *,
    chat_override: bool,
    disk_bytes: int | None = None,
) -> CatalogEntry:
    return CatalogEntry(
        id=model_id,
        path=path,
        manifest=manifest,
        can_chat=chat_override or _has_template(path, manifest),
        tokenizer_key=tokenizer_key(path),
        disk_bytes=disk_bytes,
        vocab_size=_vocab(manifest),
    )


def _vocab(manifest: Mapping[str, Any]) -> int | None:
    value = (manifest.get("architecture") or {}).get("vocab")
    return int(value) if isinstance(value, int) else None


def _has_template(path: Path, manifest: Mapping[str, Any]) -> bool:
    if manifest.get("chat_template"):
        return True
    try:  # a folder installed as is keeps its template in tokenizer_config.json
        return bool(json.loads((path / TOKENIZER_CONFIG).read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


class FolderCatalog:
    """Converted folders (each with its manifest.json), by id: the manifest's id, else the folder's name."""

    def __init__(self, folders: list[Path], *, chat_override: bool = False) -> None:
        self._entries: dict[str, CatalogEntry] = {}
        for folder in folders:
            folder = Path(folder)
            manifest = json.loads((folder / "manifest.json").read_text())
            model_id = str(manifest.get("id") or folder.name)
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            self._entries[model_id] = entry_from_folder(
                model_id, folder, manifest, chat_override=chat_override, disk_bytes=size
            )

    def entries(self) -> list[CatalogEntry]:
        return list(self._entries.values())

    def get(self, model_id: str) -> CatalogEntry | None:
        return self._entries.get(model_id)


class StoreCatalog:
    """The store's installed models (the version each would serve). Reading a manifest hashes nothing."""

    def __init__(
        self, home: Path, *, chat_override: bool = False, clock: Callable[[], float] = time.monotonic
    ) -> None:
        from models.store.store import ModelStore

        self.store = ModelStore(home)
        self._chat_override = chat_override
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, CatalogEntry] = {}
        self._versions: dict[str, str] = {}
        self._read_at: float | None = None

    def _refresh(self, force: bool = False) -> None:
        now = self._clock()
        if not force and self._read_at is not None and now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        try:
            rows = [r for r in self.store.list() if r.serving]
        except (OSError, SimmerError) as err:
            log.warning("cannot list the model store: %s", err)
            return
        entries: dict[str, CatalogEntry] = {}
        for row in rows:
            old = self._entries.get(row.id)
            if old is not None and self._versions.get(row.id) == row.version:
                entries[row.id] = old
                continue
            path = self.store.models_dir / row.id / row.version
            try:
                manifest = json.loads((path / "manifest.json").read_text())
            except (OSError, ValueError):
                continue
            entries[row.id] = entry_from_folder(
                row.id, path, manifest, chat_override=self._chat_override, disk_bytes=row.size_bytes
            )
            self._versions[row.id] = row.version
        self._entries = entries

    def entries(self) -> list[CatalogEntry]:
        with self._lock:
            self._refresh()
            return list(self._entries.values())

    def get(self, model_id: str) -> CatalogEntry | None:
        with self._lock:
            self._refresh()
            if model_id not in self._entries:
                self._refresh(force=True)  # pulled a moment ago?
            return self._entries.get(model_id)


class SingleCatalog:
    """One engine, handed over ready or opened by a factory at start: known by `alias` (SIMMER_MODEL) until
    it is loaded, then by its own id as well."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._entry: CatalogEntry | None = None

    def know(self, engine: Any) -> None:
        """Called once the engine is loaded: its facts replace the guesses."""
        self._entry = CatalogEntry(
            id=engine.model_id,
            path=getattr(engine, "model_dir", None),
            manifest=getattr(engine, "manifest", None) or {"variants": {v: {} for v in engine.variants}},
            can_chat=bool(engine.can_chat),
            tokenizer_key=getattr(engine, "tokenizer_key", engine.model_id),
            vocab_size=engine.vocab_size,
        )

    def entries(self) -> list[CatalogEntry]:
        return [self._entry] if self._entry is not None else []

    def get(self, model_id: str) -> CatalogEntry | None:
        if self._entry is not None:
            return self._entry if model_id in (self.alias, self._entry.id) else None
        if model_id == self.alias:  # not loaded yet: the factory will say what it is
            return CatalogEntry(self.alias, None, {}, can_chat=True, tokenizer_key=self.alias)
        return None
