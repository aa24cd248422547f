"""What the server can say about models, for the endpoints that describe them (Ollama's /api/tags, /api/show,
/api/ps): the installed ones (the model store), the served one (the engine; maybe a folder outside the store)
and its facts (architecture, context, variants, chat template). Plain dicts; each dialect shapes them.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.errors import SimmerError
from models.runtime.engine import nominal_variant
from models.store.store import ModelStore

if TYPE_CHECKING:
    from server.app import Runtime

log = logging.getLogger("simmer.server")


@dataclass(frozen=True)
class ModelEntry:
    id: str
    manifest: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None  # where its files are (the chat template is read from there)
    size_bytes: int = 0
    created: str = ""
    served: bool = False

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
    def default_variant(self) -> str:
        variants = self.manifest.get("variants") or {}
        return nominal_variant(self.manifest) or next(iter(variants), "")

    def chat_template(self) -> str:
        """The model's Jinja chat template source ("" for a base model)."""
        name = self.manifest.get("chat_template")
        if not name or self.folder is None:
            return ""
        try:
            return (self.folder / str(name)).read_text(encoding="utf-8")
        except OSError:
            return ""

    def variant_bytes(self, variant: str) -> int:
        entry = (self.manifest.get("variants") or {}).get(variant) or {}
        return int(entry.get("weights_bytes") or 0) + int(entry.get("onnx_bytes") or 0)


def _manifest_size(manifest: dict[str, Any]) -> int:
    files = manifest.get("files")
    if isinstance(files, dict):
        return sum(int(f.get("size") or 0) for f in files.values() if isinstance(f, dict))
    return 0


def served_entry(rt: Runtime) -> ModelEntry:
    """The model this server serves, from its engine (the manifest it was loaded with, when it has one)."""
    engine = rt.worker.engine
    manifest = getattr(engine, "manifest", None) if engine is not None else None
    manifest = manifest if isinstance(manifest, dict) else {}
    folder = getattr(engine, "model_dir", None)
    return ModelEntry(
        id=rt.model_id(),
        manifest=manifest,
        folder=Path(folder) if folder is not None else None,
        size_bytes=_manifest_size(manifest),
        created=str(manifest.get("created") or ""),
        served=True,
    )


def installed(store: ModelStore | None) -> list[ModelEntry]:
    """The current version of every installed model (versions marked bad or damaged left out)."""
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
        manifest = store.manifest(info.id, info.version) or {}
        out.append(
            ModelEntry(
                id=info.id,
                manifest=manifest,
                folder=store.models_dir / info.id / info.version,
                size_bytes=info.size_bytes,
                created=info.created,
            )
        )
    return out


def find(rt: Runtime, model: str) -> ModelEntry | None:
    """The model in use (maybe a folder outside the store) or an installed one, by exact id."""
    if model == rt.model_id():
        return served_entry(rt)
    hit = next((m for m in installed(rt.model_store) if m.id == model), None)
    if hit is None and model in rt.served_ids():  # served, but not from this store
        return served_entry(rt)
    return hit


def catalog(rt: Runtime) -> list[ModelEntry]:
    """Installed models, with the one in use first (also when it is a folder outside the store)."""
    served = served_entry(rt)
    rest = [m for m in installed(rt.model_store) if m.id != served.id]
    return [served, *rest]


def iso(timestamp: str) -> str:
    """An ISO 8601 time for the JSON (the store writes them); now when unknown."""
    if timestamp:
        return timestamp
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
