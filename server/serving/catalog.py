"""What can be served, by name: every installed model, as facts read from its manifest without loading it
(what is loaded now is serving/model_pool.py's; which one a request means, serving/model_choice.py's).

The one owner of a model's facts: the server lists these in /v1/models and Ollama's /api/tags and /api/show,
resolves a request's `model` to one of them (serving/model_choice.py), builds the governor's ladder from
them and plans memory with them. Three sources:
- `StoreCatalog`: the model store (`simmer serve`); re-read at most every REFRESH_S, so a model pulled while
  the server runs becomes servable without a restart;
- `FolderCatalog`: converted folders named by id (the benchmarks' --model-dir, tests);
- `SingleCatalog`: one engine handed over ready (or by a factory), known by its id once loaded.
`installed(store)` reads the store's list once, for what is installed but not served (Ollama's words).
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
from models.protocol import Engine
from models.runtime.engine import nominal_variant, variant_order
from models.runtime.tokenizer import TOKENIZER_CONFIG, tokenizer_key
from models.store.manifest import model_kind
from models.store.store import ModelStore

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
    created: str = ""  # when the store installed it (ISO 8601; "" when not from a store)

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

    @property
    def kind(self) -> str:
        """What the model does: "generation" or "embedding" (models/types.py)."""
        return model_kind(dict(self.manifest))

    @property
    def architecture(self) -> dict[str, Any]:
        arch = self.manifest.get("architecture")
        return arch if isinstance(arch, dict) else {}

    @property
    def family(self) -> str:
        return str(self.architecture.get("name") or "")

    @property
    def digest(self) -> str:
        """The source GGUF's sha256 (what the model was converted from), when the store recorded it."""
        source = self.manifest.get("source")
        return str(source.get("sha256") or "") if isinstance(source, dict) else ""

    @property
    def size_bytes(self) -> int:
        """Its files on disk: measured, else what the manifest lists."""
        if self.disk_bytes is not None:
            return self.disk_bytes
        files = self.manifest.get("files")
        if isinstance(files, dict):
            return sum(int(f.get("size") or 0) for f in files.values() if isinstance(f, dict))
        return 0

    def chat_template(self) -> str:
        """The model's Jinja chat template source as its manifest names it ("" for a base model)."""
        name = self.manifest.get("chat_template")
        if not name or self.path is None:
            return ""
        try:
            return (self.path / str(name)).read_text(encoding="utf-8")
        except OSError:
            return ""

    def variant_bytes(self, variant: str) -> int:
        entry = (self.manifest.get("variants") or {}).get(variant) or {}
        return int(entry.get("weights_bytes") or 0) + int(entry.get("onnx_bytes") or 0)


class Catalog(Protocol):
    def entries(self) -> list[CatalogEntry]: ...
    def get(self, model_id: str) -> CatalogEntry | None: ...
    def refresh(self) -> None:
        """Read the source again now (a model was removed)."""
        ...


def entry_from_folder(
    model_id: str,
    path: Path,
    manifest: Mapping[str, Any],
    *,
    chat_override: bool,
    disk_bytes: int | None = None,
    created: str = "",
) -> CatalogEntry:
    return CatalogEntry(
        id=model_id,
        path=path,
        manifest=manifest,
        can_chat=chat_override or _has_template(path, manifest),
        tokenizer_key=tokenizer_key(path),
        disk_bytes=disk_bytes,
        vocab_size=_vocab(manifest),
        created=created,
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

    def refresh(self) -> None:
        return None  # the folders are fixed at start


class StoreCatalog:
    """The store's installed models (the version each would serve). Reading a manifest hashes nothing."""

    def __init__(
        self, home: Path, *, chat_override: bool = False, clock: Callable[[], float] = time.monotonic
    ) -> None:
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
                row.id,
                path,
                manifest,
                chat_override=self._chat_override,
                disk_bytes=row.size_bytes,
                created=row.created,
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

    def refresh(self) -> None:
        with self._lock:
            self._refresh(force=True)


class SingleCatalog:
    """One engine, handed over ready or opened by a factory at start: known by `alias` (SIMMER_MODEL) until
    it is loaded, then by its own id as well."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._entry: CatalogEntry | None = None

    def know(self, engine: Engine) -> None:
        """Called once the engine is loaded: its facts replace the guesses."""
        manifest = engine.manifest or {"variants": {v: {} for v in engine.variants}}
        self._entry = CatalogEntry(
            id=engine.model_id,
            path=engine.model_dir,
            manifest=manifest,
            can_chat=bool(engine.can_chat),
            tokenizer_key=engine.tokenizer_key,
            vocab_size=engine.vocab_size,
            created=str(manifest.get("created") or ""),
        )

    def entries(self) -> list[CatalogEntry]:
        return [self._entry] if self._entry is not None else []

    def get(self, model_id: str) -> CatalogEntry | None:
        if self._entry is not None:
            return self._entry if model_id in (self.alias, self._entry.id) else None
        if model_id == self.alias:  # not loaded yet: the factory will say what it is
            return CatalogEntry(self.alias, None, {}, can_chat=True, tokenizer_key=self.alias)
        return None

    def refresh(self) -> None:
        return None  # one engine, nothing to read


def installed(store: ModelStore | None) -> list[CatalogEntry]:
    """The current version of every installed model (versions marked bad or damaged left out), read now:
    what a server that serves other models can say of them (Ollama's /api/tags, /api/show, /api/delete)."""
    if store is None:
        return []
    try:
        rows = store.list()
    except (SimmerError, OSError) as err:
        log.warning("cannot list the model store: %s", err)
        return []
    out = []
    for info in rows:
        if not info.serving:
            continue
        path = store.models_dir / info.id / info.version
        manifest = store.manifest(info.id, info.version) or {}
        out.append(
            entry_from_folder(
                info.id, path, manifest, chat_override=False, disk_bytes=info.size_bytes, created=info.created
            )
        )
    return out
