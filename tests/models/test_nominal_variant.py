"""The variant a model opens on, chosen from the quality measured on the machine that converts it
(models/convert/nominal.py), and the int8 reference that choice is measured against."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.convert.model import GGUFModel
from models.convert.nominal import NOMINAL_KL_FACTOR, choose_nominal, kl_mean, kl_rows
from models.convert.reference import ReferenceForward, q8_blocks


def entries(kl_q4a8: float | None) -> dict[str, dict]:
    quality = {} if kl_q4a8 is None else {"kl_mean": kl_q4a8}
    return {"q4": {"quality": {"kl_mean": 0.0}}, "q4-a8": {"quality": quality}}


@pytest.mark.parametrize(
    ("names", "kl_q4a8", "int8_kl", "chosen"),
    [
        # the int8 path costs what int8 activations cost (x86, a core without the dot product): q4-a8
        (["q4", "q4-a8"], 0.0031, 0.0028, "q4-a8"),
        (["q4", "q4-a8"], NOMINAL_KL_FACTOR * 0.002, 0.002, "q4-a8"),
        # coarser int8 kernels (one scale per row of activations): the exact variant
        (["q4", "q4-a8"], NOMINAL_KL_FACTOR * 0.002 * 1.01, 0.002, "q4"),
        (["q4", "q4-a8"], 0.03, 0.0028, "q4"),
        # nothing measured (a conversion without measuring, or an old manifest's entries): q4-a8
        (["q4", "q4-a8"], None, 0.0028, "q4-a8"),
        (["q4", "q4-a8"], 0.03, None, "q4-a8"),
        # no exact variant to fall back on: q4-a8 all the same
        (["f32", "q8", "q4-a8"], 0.03, 0.0028, "q4-a8"),
        # no q4-a8 at all: the last planned variant, as before
        (["q4"], None, None, "q4"),
    ],
)
def test_nominal_when_measured_then_q4a8_only_within_int8_activations_own_error(
    names, kl_q4a8, int8_kl, chosen
):
    variant, why = choose_nominal(names, entries(kl_q4a8), int8_kl)
    assert variant == chosen, why
    assert why


def test_kl_when_same_or_shifted_logits_then_zero_and_positive():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 50)).astype(np.float32)
    assert np.allclose(kl_rows(a, a), 0.0)
    assert np.allclose(kl_rows(a, a + 3.0), 0.0)  # a constant shift is the same distribution
    b = a.copy()
    b[:, 0] += 4.0
    assert (kl_rows(a, b) > 0).all()
    assert kl_mean([a, a], [a, b]) == pytest.approx(kl_rows(a, b).sum() / 10)


def test_q8_blocks_when_rounded_then_each_block_on_its_own_scale():
    x = np.array([[1.0] * 31 + [127.0] + [0.01] * 31 + [0.02]], np.float32)
    y = q8_blocks(x)
    assert np.array_equal(y[0, :32], x[0, :32])  # scale 1: every value is an integer already
    np.testing.assert_allclose(y[0, 32:], np.round(x[0, 32:] / (0.02 / 127)) * (0.02 / 127), rtol=1e-6)
    assert np.array_equal(q8_blocks(np.zeros((2, 64), np.float32)), np.zeros((2, 64), np.float32))


def test_int8_reference_when_tiny_model_then_close_to_fp32_but_not_equal(tiny_gguf):
    ref = ReferenceForward(GGUFModel(tiny_gguf))
    ids = [1, 5, 9, 3, 7, 2]
    fp32 = ref.logits(ids)
    ref.int8_activations = True
    int8 = ref.logits(ids)
    kl = kl_rows(fp32, int8)
    assert 0 < kl.mean() < 0.05, kl


def test_convert_when_measured_then_manifest_records_the_choice_and_its_measurements(tiny_model_dir):
    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    assert manifest["int8_reference_kl"] > 0
    assert all("kl_mean" in v["quality"] for v in manifest["variants"].values())
    variants = manifest["variants"]
    chosen, why = choose_nominal(list(variants), variants, manifest["int8_reference_kl"])
    assert (manifest["default_variant"], manifest["default_variant_reason"]) == (chosen, why)
    genai = json.loads((tiny_model_dir / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["filename"] == manifest["variants"][chosen]["file"]
