"""A BERT GGUF (llama.cpp's `bert`) through the encoder converter: the same folder a sentence-transformers
folder gives, its vectors checked against the numpy reference on the weights the GGUF holds, its tokens
against the folder's own tokenizer.json; what the graph would not run is refused by name."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from gguf import MODEL_ARCH, GGMLQuantizationType, PoolingType, get_tensor_name_map

from bench.bert_gguf import write_bert_gguf
from models.convert.encoder_config import EncoderConfig
from models.convert.encoder_convert import convert_encoder, convert_encoder_gguf
from models.convert.encoder_gguf import read_encoder_gguf
from models.convert.encoder_quality import cosines
from models.convert.families.bert import BERT
from models.errors import InvalidModelFile, UnsupportedModel, UnsupportedQuantization
from models.runtime.embedder import Embedder
from tests.reference_bert import minilm_folder, reference_embed, tiny_bert_weights
from tests.tiny_bert_gguf import checkpoint_weights, write_tiny_bert_gguf

Q = GGMLQuantizationType
SENTENCES = [
    "the cat sat on a red mat",
    "Hello, World!",
    "THE DOGS RAN; the cats sat.",
    "a big red dog ran on the mat hello world the cat",
    "unknownword the cat",
    "Thé cät sät",  # accents: stripped, as bert-base-uncased's normalizer does
    "the [MASK] sat [SEP]",  # the specials are matched in text, before WordPiece
    "cats  sitting\ton\nthe   mat",
]


def test_family_when_gguf_py_names_then_the_checkpoints_back():
    cfg = {"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16, "vocab_size": 4}
    cfg |= {"max_position_embeddings": 4, "type_vocab_size": 2}
    names = get_tensor_name_map(MODEL_ARCH.BERT, 2)
    gguf_names = []
    for name in tiny_bert_weights(cfg):
        found = names.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
        assert found is not None
        gguf_names.append(found[1])
        assert BERT.checkpoint_name(found[1]) == name
    assert sorted(BERT.gguf_names(2)) == sorted(gguf_names)
    assert BERT.checkpoint_name("blk.0.attn_qkv.weight") is None
    assert BERT.checkpoint_name("cls.output.weight") is None


@pytest.mark.parametrize(
    ("matrix_type", "bound"), [(Q.F32, 1e-5), (Q.F16, 1e-5), (Q.Q8_0, 1e-5), (Q.BF16, 1e-5)]
)
def test_convert_when_tiny_bert_gguf_then_reference_vectors_on_its_weights(
    tiny, tmp_path, matrix_type, bound
):
    _, cfg, _ = tiny
    weights = tiny_bert_weights(cfg)
    path = write_tiny_bert_gguf(tmp_path / "tiny.gguf", cfg, weights, matrix_type=matrix_type)
    out = tmp_path / "out"
    out.mkdir()
    convert_encoder_gguf(path, out)
    emb = Embedder(out)
    rows = emb.tokenize(SENTENCES)
    got = emb.embed(rows)
    held = checkpoint_weights(path, cfg, list(weights))
    want = reference_embed(held, cfg, rows, cfg["layer_norm_eps"])
    assert cosines(got, want).min() >= 0.9999
    assert np.abs(got - want).max() < bound  # fp32 against float64 on the same weights: rounding only
    if matrix_type == Q.F32:
        assert all(np.array_equal(held[n], w) for n, w in weights.items())


def test_convert_when_tiny_bert_gguf_then_tokens_and_config_as_the_folders(tiny, tmp_path):
    _, cfg, folder = tiny
    path = write_tiny_bert_gguf(tmp_path / "tiny.gguf", cfg, tiny_bert_weights(cfg))
    out = tmp_path / "out"
    out.mkdir()
    got = convert_encoder_gguf(path, out)
    emb = Embedder(out)
    assert emb.tokenize(SENTENCES) == folder.tokenize(SENTENCES)
    assert emb.tokenize(["unknownword"]) == [[2, 1, 3]]  # [CLS] [UNK] [SEP]
    # the one difference: a GGUF says the position table's length, not sentence_bert_config.json's
    assert got == dataclasses.replace(folder.config, context=cfg["max_position_embeddings"])
    assert EncoderConfig.from_json(json.loads((out / "encoder.json").read_text())) == got
    # the tokenizer keeps no truncation (the folder's carries 8)
    assert json.loads((out / "tokenizer.json").read_text())["truncation"] is None


def test_convert_when_bench_writer_then_same_as_own_writer(tiny, tmp_path):
    """bench/bert_gguf.py (convert_hf_to_gguf.py's layout, SpecialVocab's keys) reads the same."""
    src, cfg, folder = tiny
    write_bert_gguf(src, tmp_path / "bench.gguf")
    model = read_encoder_gguf(tmp_path / "bench.gguf")
    assert model.config == dataclasses.replace(folder.config, context=cfg["max_position_embeddings"])
    weights = tiny_bert_weights(cfg)
    assert model.weights.keys() == weights.keys()
    assert all(np.array_equal(model.weights[n], w) for n, w in weights.items())


@pytest.mark.parametrize("matrix_type", [Q.Q4_0, Q.Q5_1])
def test_convert_when_coarser_quantization_then_refused_by_name(tiny, tmp_path, matrix_type):
    _, cfg, _ = tiny
    path = write_tiny_bert_gguf(tmp_path / "q.gguf", cfg, tiny_bert_weights(cfg), matrix_type=matrix_type)
    with pytest.raises(UnsupportedQuantization, match=rf"is {matrix_type.name}; .*F32, F16, BF16, Q8_0"):
        read_encoder_gguf(path)


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (
            {"pooling": PoolingType.CLS},
            UnsupportedModel,
            r"pooling_type 2 is not supported \(only 1 \(mean\)\)",
        ),
        ({"meta": {"bert.attention.causal": True}}, UnsupportedModel, "causal attention"),
        (
            {"extra_tensors": {"cls.output.weight": np.zeros((2, 32), np.float32)}},
            UnsupportedModel,
            "cls.output.weight are not part of the bert encoder",
        ),
        ({"meta": {"tokenizer.ggml.normalizer.lowercase": False}}, None, ""),
    ],
)
def test_convert_when_what_the_graph_does_not_build_then_refused(tiny, tmp_path, change, error, words):
    _, cfg, _ = tiny
    path = write_tiny_bert_gguf(tmp_path / "x.gguf", cfg, tiny_bert_weights(cfg), **change)
    if error is None:  # a cased vocabulary: the flag llama.cpp reads is honoured
        model = read_encoder_gguf(path)
        assert model.tokenizer["normalizer"]["lowercase"] is False
        assert model.tokenizer["normalizer"]["strip_accents"] is False
        return
    with pytest.raises(error, match=words):
        read_encoder_gguf(path)


def test_convert_when_tensor_missing_then_invalid_file(tiny, tmp_path):
    _, cfg, _ = tiny
    weights = tiny_bert_weights(cfg)
    del weights["encoder.layer.1.output.LayerNorm.bias"]
    path = write_tiny_bert_gguf(tmp_path / "x.gguf", cfg, weights)
    with pytest.raises(InvalidModelFile, match=r"missing tensor blk\.1\.layer_output_norm\.bias"):
        read_encoder_gguf(path)


MINILM_SENTENCES = [
    "hello world",
    "The cat sat on the mat.",
    "Simmer serves small language models on phones, under a thermal governor.",
    "Ein Satz auf Deutsch, mit Umlauten: Grüße!",
    "Unbelievably, the café's décor was ___ 100% \"retro\"; I'd go again!",
    "HTTP/1.1 200 OK at 3.14159 s, twice. [MASK] [SEP]",
    "日本語のテキストと中文字符",
    "A man is eating food.",
]


@pytest.mark.slow
def test_convert_when_all_minilm_gguf_then_the_safetensors_paths_tokens_and_vectors(tmp_path):
    src = minilm_folder()
    (tmp_path / "st").mkdir()
    convert_encoder(src, tmp_path / "st")
    folder = Embedder(tmp_path / "st", threads=2)
    rows = folder.tokenize(MINILM_SENTENCES)
    want = folder.embed(rows)
    floors = {"f32": 0.99999, "f16": 0.99999, "q8_0": 0.999}  # f16: 1 - 2e-7, q8_0: 1 - 2.4e-4 measured
    for dtype, floor in floors.items():
        write_bert_gguf(src, tmp_path / f"{dtype}.gguf", dtype)
        (tmp_path / dtype).mkdir()
        cfg = convert_encoder_gguf(tmp_path / f"{dtype}.gguf", tmp_path / dtype)
        assert cfg == dataclasses.replace(folder.config, context=512)
        emb = Embedder(tmp_path / dtype, threads=2)
        assert emb.tokenize(MINILM_SENTENCES) == rows, dtype
        assert cosines(emb.embed(rows), want).min() >= floor, dtype
