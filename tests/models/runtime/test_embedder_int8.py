"""The encoder's int8 variant (MatMulNBits, 8-bit blocks, outlier channels in fp32): held to the fp32
reference at a min cosine of 0.999 and to its retrieval order on the real all-MiniLM-L6-v2; opened only when
asked for (f32 stays nominal); built plan by plan, the first within the floor kept.

The quality bounds hold on any CPU class: the int8 tested is the one a pull on this machine installs
(int8 activations where they keep the floor, else fp32 activations, whose arithmetic is the same on every
CPU), and nothing here is timed against a bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.convert import encoder_quality
from models.convert.encoder_config import GRAPHS
from models.convert.encoder_convert import convert_encoder, convert_int8
from models.convert.encoder_int8 import BLOCK, FP32_ACTIVATIONS, PLANS, pack_int8
from models.convert.encoder_quality import FLOOR, SENTENCES, check, cosines, embed_all
from models.convert.safetensors_file import read_safetensors
from models.errors import InvalidParameter
from models.runtime.embedder import MANIFEST, Embedder, opened_variant
from models.store.encoder_install import build_int8
from tests.reference_bert import minilm_folder, reference_embed, write_tiny_bert

QUERIES = (
    "How do I bake a chocolate cake?",
    "What causes earthquakes?",
    "best way to learn a programming language",
    "symptoms of the flu",
    "How does a bank loan work?",
)
DOCUMENTS = (
    "Mix flour, cocoa, sugar and eggs, then bake the batter at 180 degrees for forty minutes.",
    "Tectonic plates slide past each other and the stress released shakes the ground.",
    "Write small programs every day and read other people's code to learn a new language.",
    "Influenza brings fever, a sore throat, muscle aches and tiredness.",
    "A lender gives you money now and you repay it with interest over an agreed term.",
    "Chocolate is made from roasted and ground cacao seeds.",
    "Volcanoes erupt when magma rises through cracks in the crust.",
    "Python is a popular language for beginners and for data science.",
    "Wash your hands often to avoid catching a cold.",
    "Mortgage rates rose again this month as the central bank tightened policy.",
)
# Two documents whose f32 scores are closer than this may trade places in int8's top 3: int8 moves a score
# by up to 0.006 on this set (AVX-512 VNNI), and every other pair of neighbours in the top 3 (and the 4th)
# is at least 0.025 apart in f32. Measured there, "symptoms of the flu" swaps: its third document is the
# earthquakes one in f32 (0.0490, the cake recipe 0.0488), the cake recipe in int8 (0.0498, earthquakes
# 0.0469). That near-tie is kept in the set, not hidden: a tie has no order to keep.
TIE = 0.01


def test_pack_int8_when_dequantized_then_within_half_a_step_of_each_weight():
    w = np.random.default_rng(0).standard_normal((5, 70)).astype(np.float32)  # 70: a partial last block
    codes, scales = pack_int8(w)
    assert codes.shape == (5, 3, BLOCK) and scales.shape == (15,)
    back = ((codes.astype(np.float64) - 128) * scales.reshape(5, 3, 1)).reshape(5, -1)[:, :70]
    step = np.repeat(scales.reshape(5, 3), BLOCK, axis=1)[:, :70]
    assert np.all(np.abs(back - w) <= step / 2 + 1e-7)


@pytest.mark.parametrize(
    ("quality", "verdict"),
    [
        ({"min_cosine": 0.9995}, None),
        ({"min_cosine": 0.999}, None),
        ({"min_cosine": 0.9983}, "< 0.999"),
        ({}, "not"),
    ],
)
def test_check_when_measured_then_the_worst_sentence_against_the_floor(quality, verdict):
    got = check(quality)
    assert (got is None) if verdict is None else (verdict in got)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("tiny-bert")
    write_tiny_bert(src, context=16)
    out = tmp_path_factory.mktemp("tiny-encoder")
    convert_encoder(src, out)
    convert_int8(src, out)
    return out


ROWS = [[2, 5, 6, 7, 3], [2, 12, 13, 7, 8, 9, 10, 11, 3]]


def test_embedder_when_int8_asked_then_opens_it_and_f32_stays_the_default(tiny):
    exact = Embedder(tiny)
    int8 = Embedder(tiny, variant="int8")
    assert (exact.variant, int8.variant) == ("f32", "int8")
    got, want = int8.embed(ROWS), exact.embed(ROWS)
    assert not np.array_equal(got, want) and cosines(got, want).min() > 0.99


def test_embedder_when_variant_not_installed_then_refused_naming_what_is(tiny, tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"default_variant": "f32", "variants": {"f32": {}}}))
    for f in tiny.iterdir():
        if f.name != MANIFEST:
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(InvalidParameter, match="installed: f32"):
        Embedder(tmp_path, variant="int8")
    with pytest.raises(InvalidParameter, match="no encoder variant 'q4'"):
        Embedder(tiny, variant="q4")


def test_opened_variant_when_preferred_then_only_where_the_model_has_it(tiny, tmp_path):
    assert [opened_variant(tiny, v) for v in (None, "int8", "f32", "q4")] == ["f32", "int8", "f32", "f32"]
    (tmp_path / MANIFEST).write_text(json.dumps({"default_variant": "f32", "variants": {"f32": {}}}))
    assert opened_variant(tmp_path, "int8") == "f32"  # installed without int8: the nominal one


def test_shelf_when_variant_preferred_then_opens_it_and_counts_only_its_graph(tiny):
    from server.serving.embedding import EncoderShelf

    assert EncoderShelf().get("tiny", tiny).variant == "f32"
    assert EncoderShelf(variant="q4").get("tiny", tiny).variant == "f32"  # a decoder's variant name
    shelf = EncoderShelf(variant="int8")
    assert shelf.get("tiny", tiny).variant == "int8"
    f32_bytes = sum((tiny / f).stat().st_size for f in ("encoder.onnx", "encoder.onnx.data"))
    everything = sum(f.stat().st_size for f in tiny.iterdir() if f.is_file())
    view = shelf.view()
    assert view is not None and view.bytes == everything - f32_bytes


def test_build_int8_when_int8_activations_miss_the_floor_then_fp32_ones_are_tried(tmp_path, monkeypatch):
    src, out = tmp_path / "src", tmp_path / "out"
    write_tiny_bert(src, context=16)
    out.mkdir()
    convert_encoder(src, out)
    measured = iter([0.9985, 0.9997])

    def fake_quality(folder):
        return {"min_cosine": next(measured), "mean_cosine": 0.9999, "method": "fake"}

    monkeypatch.setattr(encoder_quality, "measure_quality", fake_quality)
    entry, why = build_int8(src, out)
    assert entry is not None and why == ""
    assert (entry["plan"], entry["accuracy_level"]) == (PLANS[FP32_ACTIVATIONS], FP32_ACTIVATIONS)
    assert [a["verdict"] for a in entry["attempts"]] == ["min cosine 0.99850 < 0.999", "within the floor"]
    emb = Embedder(out, variant="int8")
    assert emb.embed(ROWS).shape == (2, emb.dimensions)


def test_build_int8_when_no_plan_within_the_floor_then_refused_and_nothing_left(tmp_path, monkeypatch):
    src, out = tmp_path / "src", tmp_path / "out"
    write_tiny_bert(src, context=16)
    out.mkdir()
    convert_encoder(src, out)
    before = sorted(f.name for f in out.iterdir())
    monkeypatch.setattr(encoder_quality, "FLOOR", 1.01)
    entry, why = build_int8(src, out)
    assert entry is None and why.count("< 1.01") == len(PLANS)
    assert sorted(f.name for f in out.iterdir()) == before


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> tuple[Path, dict]:
    """The real all-MiniLM-L6-v2 with the int8 variant a pull on this machine installs."""
    out = tmp_path_factory.mktemp("minilm-int8")
    convert_encoder(minilm_folder(), out)
    entry, why = build_int8(minilm_folder(), out)
    assert entry is not None, why
    return out, entry


@pytest.mark.slow
def test_int8_when_all_minilm_then_every_sentence_within_the_floor_of_the_fp32_reference(minilm):
    out, entry = minilm
    emb = Embedder(out, threads=2, variant="int8")
    rows = emb.tokenize(SENTENCES, fit=True)
    src = minilm_folder()
    cfg = json.loads((src / "config.json").read_text())
    want = reference_embed(read_safetensors(src / "model.safetensors"), cfg, rows, cfg["layer_norm_eps"])
    cos = cosines(embed_all(emb, rows), want)
    assert cos.min() >= FLOOR, f"{entry['plan']}: min {cos.min():.5f} mean {cos.mean():.5f}"
    # what the pull recorded is the same measurement against the f32 graph (the reference's to 2e-8)
    assert abs(entry["quality"]["min_cosine"] - cos.min()) < 1e-5


@pytest.mark.slow
def test_int8_when_all_minilm_then_top1_kept_and_top3_changes_only_between_near_ties(minilm):
    out, _ = minilm

    def scores(variant: str) -> np.ndarray:
        emb = Embedder(out, threads=2, variant=variant)
        docs = embed_all(emb, emb.tokenize(DOCUMENTS))
        return embed_all(emb, emb.tokenize(QUERIES)) @ docs.T

    exact, got = scores("f32"), scores("int8")
    want_top, got_top = np.argsort(-exact, axis=1)[:, :3], np.argsort(-got, axis=1)[:, :3]
    assert want_top[:, 0].tolist() == [0, 1, 2, 3, 4]  # the set is a real test: each query finds its answer
    assert got_top[:, 0].tolist() == want_top[:, 0].tolist()  # every top-1 unchanged
    for q in range(len(QUERIES)):
        for i in range(1, 3):
            a, b = want_top[q, i], got_top[q, i]
            assert a == b or abs(exact[q, a] - exact[q, b]) < TIE, (
                f"{QUERIES[q]!r}: int8's top 3 {got_top[q].tolist()}, f32's {want_top[q].tolist()}"
            )


@pytest.mark.slow
def test_measure_speed_when_all_minilm_then_each_variant_timed(minilm):
    out, _ = minilm
    speed = encoder_quality.measure_speed(out, list(GRAPHS))
    assert set(speed) == set(GRAPHS) and all(s["sentences_per_cpu_s"] > 0 for s in speed.values())
