"""`simmer pull ./folder`: a model folder in onnxruntime-genai's layout, installed as is.

The folder (genai_config.json, the ONNX decoder and its external data, tokenizer.json, usually
tokenizer_config.json) goes through the store's own install path: `LocalFolder` is its source (its "sha256"
is that of the folder's SHA256SUMS-style listing, so the version changes when any file does) and
`FOLDER_INSTALLER` stands where the converter stands: it copies the files instead of converting, and its
smoke test checks that the copy is what was hashed and that the decoder loads and decodes. The manifest's
variant records the decoder's I/O (DecoderIO), which puts the engine on its general path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import (
    HashMismatch,
    InvalidModelFile,
    InvalidParameter,
    ModelNotFound,
    SimmerError,
    VerificationFailed,
)
from models.runtime.genai_config import GENAI_CONFIG, DecoderIO, load_tokenizer
from models.runtime.tokenizer import TOKENIZER_JSON
from models.store.paths import inside
from models.store.sources import CHUNK, FetchedFile, Progress, sha256_file

VARIANT = "genai"
MANIFEST = "manifest.json"  # the store's; a folder copied out of our store may carry one


def is_genai_folder(path: Path) -> bool:
    return (Path(path).expanduser() / GENAI_CONFIG).is_file()


def folder_files(folder: Path) -> list[str]:
    """Every file to install, as sorted relative paths: hidden files and folders (.git, .cache) and a
    manifest of ours stay behind. Symlinks are followed (a Hugging Face snapshot is made of them)."""
    out = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or rel.as_posix() == MANIFEST:
            continue
        if path.is_file():
            out.append(rel.as_posix())
    return out


def listing_sha256(hashes: dict[str, str]) -> str:
    """The sha256 of a SHA256SUMS-style listing: one identity for a whole folder."""
    text = "".join(f"{digest}  {rel}\n" for rel, digest in sorted(hashes.items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_folder(folder: Path) -> DecoderIO:
    """A clear error before anything is copied: the config parses and names files that exist."""
    io = DecoderIO.from_folder(folder)
    missing = [name for name in (io.filename, TOKENIZER_JSON) if not (folder / name).is_file()]
    if missing:
        raise InvalidModelFile(f"{folder} has {GENAI_CONFIG} but no {' or '.join(missing)}")
    return io


@dataclass(frozen=True)
class LocalFolder:
    """An onnxruntime-genai folder on disk; `sha256` pins its listing's sha256 (see listing_sha256)."""

    path: Path
    sha256: str | None = None
    size: int | None = None
    kind: str = field(default="genai-folder", init=False)

    def fetch(self, downloads: Path, progress: Progress | None = None) -> FetchedFile:
        folder = Path(self.path).expanduser().resolve()
        if not folder.is_dir():
            raise ModelNotFound(f"no such folder: {self.path}")
        check_folder(folder)
        files = folder_files(folder)
        hashes, size = {}, 0
        for i, rel in enumerate(files):
            hashes[rel] = sha256_file(folder / rel)
            size += (folder / rel).stat().st_size
            if progress:
                progress("hash", (i + 1) / len(files))
        digest = listing_sha256(hashes)
        if self.sha256 is not None and self.sha256.lower() != digest:
            raise HashMismatch(
                f"sha256 mismatch for the listing of {folder}: expected {self.sha256}, got {digest}"
            )
        return FetchedFile(folder, digest, size)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(Path(self.path).expanduser().resolve())}


def copy_folder(
    src: Path,
    out_dir: Path,
    *,
    variants: list[str] | None = None,
    progress: Progress | None = None,
    disk_plan: Callable[[dict[str, int]], None] | None = None,
) -> dict[str, Any]:
    """The converter's seam, for a folder: copy every file (streamed) and describe it for the manifest.
    `disk_plan` gets the bytes of every file before the first is copied (the store checks free space)."""
    if variants and set(variants) != {VARIANT}:
        raise InvalidParameter(
            f"an onnxruntime-genai folder is installed as is: its one variant is {VARIANT!r}, "
            f"not {', '.join(variants)}",
            param="variants",
        )
    io = check_folder(Path(src))
    files = folder_files(Path(src))
    sizes = {rel: (Path(src) / rel).stat().st_size for rel in files}
    if disk_plan is not None:
        disk_plan(sizes)
    total = max(1, sum(sizes.values()))
    done = 0
    for rel in files:
        target = inside(out_dir, *rel.split("/"), what=f"{rel} of {src}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with (Path(src) / rel).open("rb") as fin, target.open("wb") as fout:
            while chunk := fin.read(CHUNK):
                fout.write(chunk)
                done += len(chunk)
                if progress:
                    progress("copy", done / total)
    # The decoder and the files it references by name (external data) are the variant's weights.
    decoder_files = [io.filename, *_external_data(out_dir / io.filename)]
    entry = {
        "file": io.filename,
        "files": decoder_files,
        "weights_bytes": sum((out_dir / rel).stat().st_size for rel in decoder_files),
        "genai": io.to_dict(),
    }
    return {
        "architecture": io.architecture(),
        "context_length": io.context_length,
        "variants": {VARIANT: entry},
        "default_variant": VARIANT,
        "tokenizer": TOKENIZER_JSON,
        "chat_template": None,
    }


def _external_data(onnx_file: Path) -> list[str]:
    import onnx

    try:
        model = onnx.load(str(onnx_file), load_external_data=False)
    except Exception as err:  # onnx raises DecodeError and friends
        raise InvalidModelFile(f"{onnx_file.name} is not a readable ONNX model: {err}") from err
    names = set()
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                names.add((onnx_file.parent / entry.value).relative_to(onnx_file.parent).as_posix())
    return sorted(names)


def smoke_test(model_dir: Path, manifest: dict[str, Any]) -> None:
    """The copy is the folder that was hashed, the tokenizer loads, and the decoder decodes a few tokens."""
    hashes = {rel: meta["sha256"] for rel, meta in manifest["files"].items() if rel != MANIFEST}
    if listing_sha256(hashes) != manifest["source"]["sha256"]:
        raise VerificationFailed("the folder changed while it was being copied; pull it again")
    from models.runtime.session import GeneralDecoderSession

    io = DecoderIO.from_dict(manifest["variants"][VARIANT]["genai"])
    try:
        load_tokenizer(model_dir, io)
        sess = GeneralDecoderSession(Path(model_dir) / io.filename, io, 1)
        kv = sess.new_cache(16)
        first = io.bos_id if io.bos_id is not None else 0
        ids = np.array([first, *(i % io.vocab for i in (1, 2, 3))], np.int64)
        logits = sess.run(ids, kv, 0)
        for pos in range(4, 8):
            if logits.shape != (io.vocab,) or not np.isfinite(logits).all():
                raise VerificationFailed(
                    f"the decoder gave logits of shape {logits.shape} with non-finite values"
                )
            logits = sess.run(np.array([int(logits.argmax())]), kv, pos)
    except SimmerError as err:
        raise VerificationFailed(err.message) from err
    except Exception as err:  # onnxruntime's own error types
        raise VerificationFailed(f"the decoder failed to run: {err}") from err


@dataclass(frozen=True)
class FolderInstaller:
    """Stands where models.store.store.Converter stands (the same attributes)."""

    convert: Any = copy_folder
    smoke_test: Any = smoke_test
    version: int = 1
    plans_disk: bool = True  # copy_folder reports its files' sizes before copying
    variants: frozenset[str] | None = None  # a folder's variants are whatever it holds: not checked ahead


FOLDER_INSTALLER = FolderInstaller()
