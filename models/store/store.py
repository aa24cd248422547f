"""The model store: `<home>/models/<id>/<version>/` folders with a manifest, installed atomically.

Layout:
    <home>/downloads/                 cached source GGUFs (see models/store/sources.py)
    <home>/models/.locks/<id>.lock    one pull/remove of a model at a time (flock)
    <home>/models/<id>/current        names the current version: the commit point of an install
    <home>/models/<id>/<version>/     converted files + manifest.json (written last)
    <home>/models/<id>/.tmp-*         an install in progress, or leftovers of a killed one

A model is installed when `current` names a version folder whose manifest is valid and whose files have
the sizes the manifest records. Every step before `current` is rewritten (convert into .tmp-*, fsync,
manifest last, rename, verify) can be killed without leaving anything that looks installed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import (
    InsufficientDiskSpace,
    InvalidModelFile,
    ModelNotInstalled,
    SimmerError,
    VerificationFailed,
)
from models.runtime.session import kv_bytes_per_token
from models.store import registry
from models.store.durable import fsync_dir as _fsync_dir
from models.store.hub import HubConfig
from models.store.sources import FetchedFile, Progress, sha256_file

SCHEMA = 1
MANIFEST = "manifest.json"
CURRENT = "current"
TMP_PREFIX = ".tmp-"
MB = 1024 * 1024


@dataclass(frozen=True)
class Converter:
    """The converter seam (models/convert/pipeline.py in production, a fake in tests)."""

    convert: Callable[..., dict]
    smoke_test: Callable[[Path, dict], None]
    version: int = 1


def default_converter() -> Converter:
    """Import the real converter lazily: onnx and friends are only needed when converting."""
    try:
        from models.convert import pipeline as mod
    except ModuleNotFoundError as err:
        if err.name not in ("models.convert.pipeline", "models.gguf.reader"):
            raise
        raise SimmerError(f"the GGUF converter is not available ({err})") from err
    return Converter(mod.convert, mod.smoke_test, int(getattr(mod, "CONVERTER_VERSION", 1)))


def version_name(gguf_sha256: str, converter_version: int) -> str:
    return f"{gguf_sha256[:12]}-c{converter_version}"


@dataclass(frozen=True)
class InstalledModel:
    id: str
    version: str
    path: Path
    manifest: dict[str, Any]

    @property
    def variants(self) -> dict[str, Any]:
        return self.manifest.get("variants", {})

    @property
    def size_bytes(self) -> int:
        return sum(f["size"] for f in self.manifest["files"].values())


@dataclass(frozen=True)
class ModelInfo:
    """One line of `simmer list`."""

    id: str
    version: str
    variants: list[str]
    size_bytes: int
    current: bool
    created: str
    problem: str | None = None  # set when the folder fails the size check


@dataclass
class ModelStore:
    home: Path
    converter: Converter | None = None
    free_bytes: Callable[[Path], int] = field(default=lambda p: shutil.disk_usage(p).free)
    disk_factor: float = 4.0  # converting needs about this many times the GGUF size ...
    disk_extra_mb: int = 200  # ... plus this much
    log: Callable[[str], None] = field(default=lambda msg: None)
    # Called with a stage name at each step of an install; tests use it to kill -9 at exact points.
    checkpoint: Callable[[str], None] = field(default=lambda stage: None)
    hub: HubConfig | None = None  # the Hugging Face Hub for hf: models (endpoint, token, offline)

    def __post_init__(self) -> None:
        self.home = Path(self.home).expanduser()

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def downloads_dir(self) -> Path:
        return self.home / "downloads"

    def _converter(self) -> Converter:
        if self.converter is None:
            self.converter = default_converter()
        return self.converter

    # ---- pull ----------------------------------------------------------------------------------------

    def pull(
        self,
        name: str,
        progress: Progress | None = None,
        *,
        sha256: str | None = None,
        variants: list[str] | None = None,
        force: bool = False,
    ) -> InstalledModel:
        """Fetch, convert, verify and install `name`. Does nothing when it is already installed."""
        spec = registry.resolve(name, sha256=sha256, hub=self.hub)
        conv = spec.installer or self._converter()
        model_dir = self.models_dir / spec.id
        with self._lock(spec.id):
            model_dir.mkdir(parents=True, exist_ok=True)
            self._clean_stale(model_dir)
            if not force and spec.source.sha256:
                done = self._already_installed(
                    spec.id, version_name(spec.source.sha256, conv.version), variants
                )
                if done is not None:
                    return done
            if spec.source.size is not None:
                self._check_disk(spec.source.size)
            fetched = spec.source.fetch(self.downloads_dir, progress)
            version = version_name(fetched.sha256, conv.version)
            if not force:
                done = self._already_installed(spec.id, version, variants)
                if done is None:
                    done = self._reuse_kept_version(spec.id, version, variants, progress)
                if done is not None:
                    return done
            self._check_disk(fetched.size)
            return self._install(spec, fetched, version, conv, progress, variants)

    def _already_installed(
        self, model_id: str, version: str, variants: list[str] | None
    ) -> InstalledModel | None:
        if self._read_current(model_id) != version:
            return None
        try:
            model = self._load_version(model_id, version)
        except SimmerError as err:
            self.log(f"{model_id} {version} is damaged ({err.message}); reinstalling")
            return None
        if variants and not set(variants) <= set(model.variants):
            return None
        self.log(f"{model_id} {version} is already installed")
        return model

    def _reuse_kept_version(
        self, model_id: str, version: str, variants: list[str] | None, progress: Progress | None
    ) -> InstalledModel | None:
        """A complete folder for this version that is not current (kept previous, or a pull killed just
        before the commit point): check every hash and make it current instead of converting again."""
        if not (self.models_dir / model_id / version).is_dir():
            return None
        try:
            model = self._verify_version(model_id, version, progress)
        except SimmerError:
            return None
        if variants and not set(variants) <= set(model.variants):
            return None
        previous = self._read_current(model_id)
        self._write_current(model_id, version)
        self._prune(model_id, keep={version, previous})
        self.log(f"{model_id} {version} was already converted; it is current again")
        return model

    def _install(
        self,
        spec: registry.ModelSpec,
        fetched: FetchedFile,
        version: str,
        conv: Converter,
        progress: Progress | None,
        variants: list[str] | None,
    ) -> InstalledModel:
        model_dir = self.models_dir / spec.id
        previous = self._read_current(spec.id)
        if previous and previous != version:
            keeping = f"; current version stays {previous}"
        else:
            keeping = f"; {spec.id} is not installed"
        tmp = model_dir / f"{TMP_PREFIX}{secrets.token_hex(6)}"
        tmp.mkdir()
        displaced: Path | None = None
        try:
            self.checkpoint("converting")
            fragment = conv.convert(fetched.path, tmp, variants=variants, progress=progress)
            self.checkpoint("converted")
            files = _hash_and_sync_tree(tmp, progress)
            manifest = build_manifest(spec, fetched, version, fragment, files)
            try:
                if progress:
                    progress("smoke test", 0.0)
                conv.smoke_test(tmp, manifest)
                if progress:
                    progress("smoke test", 1.0)
            except SimmerError as err:
                raise VerificationFailed(
                    f"{spec.id} {version} failed the smoke test ({err.message}); removed it{keeping}"
                ) from err
            _write_json_durably(tmp / MANIFEST, manifest)
            self.checkpoint("manifest-written")
            final = model_dir / version
            if final.exists():  # a damaged or forced reinstall of the same version
                displaced = model_dir / f"{TMP_PREFIX}old-{secrets.token_hex(6)}"
                final.rename(displaced)
            tmp.rename(final)
            _fsync_dir(model_dir)
            self.checkpoint("renamed")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            model = self._verify_version(spec.id, version, progress)
        except SimmerError as err:
            shutil.rmtree(final, ignore_errors=True)
            raise VerificationFailed(
                f"{spec.id} {version} failed verification ({err.message}){keeping}"
            ) from err
        self._write_current(spec.id, version)
        self.checkpoint("current-written")
        if displaced is not None:
            shutil.rmtree(displaced, ignore_errors=True)
        self._prune(spec.id, keep={version, previous})
        self.log(f"installed {spec.id} {version}")
        return model

    # ---- load / verify / list / remove --------------------------------------------------------------

    def load(self, name: str) -> InstalledModel:
        """The current version of an installed model, after checking every file's size."""
        model_id = registry.model_id(name)
        version = self._read_current(model_id)
        if version is None:
            raise self._not_installed(model_id)
        return self._load_version(model_id, version)

    def verify(self, name: str, progress: Progress | None = None) -> InstalledModel:
        """Check the sha256 of every file of the current version against the manifest."""
        model_id = registry.model_id(name)
        version = self._read_current(model_id)
        if version is None:
            raise self._not_installed(model_id)
        return self._verify_version(model_id, version, progress)

    def list(self) -> list[ModelInfo]:
        out: list[ModelInfo] = []
        if not self.models_dir.is_dir():
            return out
        for model_dir in sorted(
            p for p in self.models_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
        ):
            current = self._read_current(model_dir.name)
            for vdir in sorted(p for p in model_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
                manifest = _read_manifest(vdir, model_dir.name, vdir.name)
                if manifest is None:
                    continue  # not an installed version (no valid manifest)
                problem = None
                try:
                    _check_sizes(vdir, manifest)
                except VerificationFailed as err:
                    problem = err.message
                out.append(
                    ModelInfo(
                        id=model_dir.name,
                        version=vdir.name,
                        variants=sorted(manifest.get("variants", {})),
                        size_bytes=sum(f["size"] for f in manifest["files"].values()),
                        current=vdir.name == current,
                        created=manifest.get("created", ""),
                        problem=problem,
                    )
                )
        return out

    def remove(self, name: str) -> None:
        """Remove every version of a model. `current` goes first, so a kill leaves it not installed."""
        model_id = registry.model_id(name)
        model_dir = self.models_dir / model_id
        with self._lock(model_id):
            if not model_dir.is_dir():
                raise self._not_installed(model_id)
            (model_dir / CURRENT).unlink(missing_ok=True)
            _fsync_dir(model_dir)
            trash = self.models_dir / f".trash-{model_id}-{secrets.token_hex(6)}"
            model_dir.rename(trash)
            _fsync_dir(self.models_dir)
            shutil.rmtree(trash, ignore_errors=True)

    # ---- internals -----------------------------------------------------------------------------------

    def _not_installed(self, model_id: str) -> ModelNotInstalled:
        installed = sorted({m.id for m in self.list() if m.current})
        listed = ", ".join(installed) if installed else "none"
        return ModelNotInstalled(
            f"model {model_id!r} is not installed (installed: {listed}); run `simmer pull {model_id}`",
            param="model",
        )

    def _load_version(self, model_id: str, version: str) -> InstalledModel:
        vdir = self.models_dir / model_id / version
        manifest = _read_manifest(vdir, model_id, version)
        if manifest is None:
            raise ModelNotInstalled(
                f"model {model_id!r} is not installed: version {version} has no valid manifest; "
                f"run `simmer pull {model_id}`",
                param="model",
            )
        _check_sizes(vdir, manifest)
        return InstalledModel(model_id, version, vdir, manifest)

    def _verify_version(
        self, model_id: str, version: str, progress: Progress | None = None
    ) -> InstalledModel:
        model = self._load_version(model_id, version)
        bad = []
        files = model.manifest["files"]
        for i, (rel, meta) in enumerate(sorted(files.items())):
            actual = sha256_file(model.path / rel)
            if actual != meta["sha256"]:
                bad.append(f"{rel} (sha256 {actual}, expected {meta['sha256']})")
            if progress:
                progress("verify", (i + 1) / len(files))
        if bad:
            raise VerificationFailed(f"{model_id} {version}: corrupted file(s): {'; '.join(bad)}")
        return model

    def _read_current(self, model_id: str) -> str | None:
        try:
            text = (self.models_dir / model_id / CURRENT).read_text(encoding="utf-8").strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        # The pointer names a sibling folder; anything else is treated as no pointer at all.
        return text if registry.ID_PATTERN.match(text) else None

    def _write_current(self, model_id: str, version: str) -> None:
        model_dir = self.models_dir / model_id
        tmp = model_dir / f"{TMP_PREFIX}current-{secrets.token_hex(6)}"
        with tmp.open("w", encoding="utf-8") as f:
            f.write(version + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(model_dir / CURRENT)
        _fsync_dir(model_dir)

    def _prune(self, model_id: str, keep: set[str | None]) -> None:
        """Keep the current version and the one it replaced; remove older ones."""
        model_dir = self.models_dir / model_id
        for vdir in model_dir.iterdir():
            if vdir.is_dir() and not vdir.name.startswith(".") and vdir.name not in keep:
                shutil.rmtree(vdir, ignore_errors=True)

    def _clean_stale(self, model_dir: Path) -> None:
        # Safe: we hold this model's lock, so no live install owns these.
        for stale in model_dir.glob(f"{TMP_PREFIX}*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        for trash in self.models_dir.glob(".trash-*"):
            shutil.rmtree(trash, ignore_errors=True)

    def _check_disk(self, gguf_size: int) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        needed = int(gguf_size * self.disk_factor) + self.disk_extra_mb * MB
        available = self.free_bytes(self.home)
        if available < needed:
            raise InsufficientDiskSpace(
                f"not enough free disk space in {self.home}: need about {needed // MB} MB "
                f"to convert, {available // MB} MB available"
            )

    @contextlib.contextmanager
    def _lock(self, model_id: str) -> Iterator[None]:
        locks = self.models_dir / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with (locks / f"{model_id}.lock").open("a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ---- manifest and files ------------------------------------------------------------------------------


def build_manifest(
    spec: registry.ModelSpec,
    fetched: FetchedFile,
    version: str,
    fragment: dict[str, Any],
    files: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    variants = fragment.get("variants") or {}
    if not variants:
        raise InvalidModelFile(f"the converter produced no variants for {spec.id}")
    for name, variant in variants.items():
        for rel in [variant.get("file"), *variant.get("files", [])]:
            if rel is not None and rel not in files:
                raise VerificationFailed(f"variant {name} names {rel}, which the converter did not write")
    # gguf_path: where the source GGUF was read from (a download cache entry may be gone later).
    source = {
        **spec.source.describe(),
        "sha256": fetched.sha256,
        "size": fetched.size,
        "gguf_path": str(fetched.path),
    }
    return {
        "schema": SCHEMA,
        "id": spec.id,
        "version": version,
        "source": source,
        "context_length": fragment.get("context_length"),
        "architecture": fragment.get("architecture", {}),
        "variants": variants,
        "tokenizer": fragment.get("tokenizer"),
        "chat_template": fragment.get("chat_template"),
        "files": files,
        "memory": memory_estimate(fragment, files),
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _arch_value(arch: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        if isinstance(arch.get(key), int):
            return arch[key]
    return None


def memory_estimate(fragment: dict[str, Any], files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rough resident memory per variant: what loading it costs (the converter's measured
    `memory.load_rss_bytes` when it gives one, else its weights, else the size of its files) plus the KV
    cache at the full context length. `kv_bytes_per_token` lets callers redo this for a smaller context."""
    arch = fragment.get("architecture") or {}
    layers = _arch_value(arch, "n_layers", "num_hidden_layers", "block_count", "layers")
    kv_heads = _arch_value(arch, "n_kv_heads", "num_key_value_heads", "head_count_kv", "kv_heads")
    head_dim = _arch_value(arch, "head_dim", "head_size")
    kv_per_token = None
    if layers and kv_heads and head_dim:
        kv_per_token = kv_bytes_per_token(layers, kv_heads, head_dim)
    context = fragment.get("context_length") or 0
    out: dict[str, Any] = {"kv_bytes_per_token": kv_per_token, "context_length": context, "variants": {}}
    for name, variant in (fragment.get("variants") or {}).items():
        weights = variant.get("weights_bytes")
        if not isinstance(weights, int):
            rels = set(variant.get("files") or []) | ({variant["file"]} if variant.get("file") else set())
            weights = sum(files[r]["size"] for r in rels if r in files)
        measured = (variant.get("memory") or {}).get("load_rss_bytes")
        load = measured if isinstance(measured, int) else weights
        out["variants"][name] = {
            "weights_bytes": weights,
            "load_bytes": load,
            "estimate_bytes": load + (kv_per_token or 0) * context,
        }
    return out


def _hash_and_sync_tree(root: Path, progress: Progress | None) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under root, fsyncing each file and folder on the way."""
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    files: dict[str, dict[str, Any]] = {}
    for i, path in enumerate(paths):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            raise InvalidModelFile(f"the converter wrote {MANIFEST}, which the store owns")
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        if progress:
            progress("hash", (i + 1) / len(paths))
    for folder in sorted({p.parent for p in paths} | {root}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(folder)
    return files


def _read_manifest(vdir: Path, model_id: str, version: str) -> dict[str, Any] | None:
    try:
        manifest = json.loads((vdir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(manifest, dict)
        and manifest.get("schema") == SCHEMA
        and manifest.get("id") == model_id
        and manifest.get("version") == version
        and isinstance(manifest.get("files"), dict)
        and all(isinstance(m, dict) and "size" in m and "sha256" in m for m in manifest["files"].values())
    )
    return manifest if ok else None


def _check_sizes(vdir: Path, manifest: dict[str, Any]) -> None:
    problems = []
    for rel, meta in sorted(manifest["files"].items()):
        try:
            size = (vdir / rel).stat().st_size
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
            continue
        if size != meta["size"]:
            problems.append(f"{rel} has {size} bytes, expected {meta['size']}")
    if problems:
        raise VerificationFailed(
            f"{manifest['id']} {manifest['version']} is damaged: {'; '.join(problems)}; "
            f"run `simmer pull {manifest['id']}` to reinstall"
        )


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)
