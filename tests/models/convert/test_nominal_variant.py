"""The one rule for the variant a model opens on (models/convert/nominal.py), table by table: the floor
(llama.cpp's KL when measured, else the int8 reference's), the candidates within it, the fastest of
them, the exact q4 when none is, and what a pull keeps; the int8 reference the floor falls back on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.convert import nominal
from models.convert.model import GGUFModel
from models.convert.quality import kl_rows
from models.convert.reference import ReferenceForward, llama_activations, q8_blocks

LLAMA = {"source": "llama.cpp", "kl_mean": 0.0027, "kl_p99": 0.013}  # SmolLM2's on x86, 512 positions


def entry(kl: float | None, cpu: float | None = None, p99: float | None = None) -> dict:
    quality = {} if kl is None else {"kl_mean": kl, "kl_p99": 5 * kl if p99 is None else p99}
    return {"quality": quality, **({"speed": {"cpu_s_per_token": cpu}} if cpu is not None else {})}


@pytest.mark.parametrize(
    ("installed", "entries", "floor", "chosen"),
    [
        # both candidates within the floor: the faster one; a tie goes to q4-a8
        (["q4-a8", "fast"], {"q4-a8": entry(0.002, 0.02), "fast": entry(0.0025, 0.015)}, LLAMA, "fast"),
        (["q4-a8", "fast"], {"q4-a8": entry(0.002, 0.02), "fast": entry(0.0025, 0.03)}, LLAMA, "q4-a8"),
        (["q4-a8", "fast"], {"q4-a8": entry(0.002, 0.02), "fast": entry(0.002, 0.02)}, LLAMA, "q4-a8"),
        # one within it: that one, however fast the other is
        (["q4-a8", "fast"], {"q4-a8": entry(0.002, 0.02), "fast": entry(0.004, 0.001)}, LLAMA, "q4-a8"),
        # a tail beyond the floor's p99 is beyond it too
        (["q4", "q4-a8"], {"q4": entry(1e-11), "q4-a8": entry(0.002, 0.02, p99=0.02)}, LLAMA, "q4"),
        # none within it (ARM's coarser int8 kernels; SmolLM2's q4-a8 at 1.16x llama.cpp's): the exact q4
        (["q4", "q4-a8"], {"q4": entry(1e-11, 0.001), "q4-a8": entry(0.0031, 0.02)}, LLAMA, "q4"),
        (
            ["q4", "q4-a8"],
            {"q4": entry(1e-11), "q4-a8": entry(0.03, 0.02)},
            nominal.int8_floor({"kl_mean": 0.0028, "kl_p99": 0.014}),
            "q4",
        ),
        # ... and as it is: SmolLM2's q4-a8 on x86 (1.24x the int8 reference's mean) is not within it
        (
            ["q4", "q4-a8"],
            {"q4": entry(1e-11), "q4-a8": entry(0.0031, 0.02, p99=0.0141)},
            nominal.int8_floor({"kl_mean": 0.0025, "kl_p99": 0.0146}),
            "q4",
        ),
        # Gemma's fast on a K-quant file, well inside the int8 reference's (which rounds per 256 there)
        (
            ["q4", "fast"],
            {"q4": entry(1e-11), "fast": entry(0.0035, 0.02, p99=0.027)},
            nominal.int8_floor({"kl_mean": 0.0076, "kl_p99": 0.048}),
            "fast",
        ),
        # no exact variant to fall back on (a float source): the fastest candidate all the same
        (
            ["f32", "q8", "q4-a8"],
            {"f32": entry(0.0), "q8": entry(0.001), "q4-a8": entry(0.03)},
            LLAMA,
            "q4-a8",
        ),
        # nothing measured: q4-a8; no candidate at all: the source's last variant
        (["q4", "q4-a8"], {"q4": {}, "q4-a8": {}}, None, "q4-a8"),
        (["f32", "q8"], {"f32": {}, "q8": {}}, LLAMA, "q8"),
    ],
)
def test_choose(installed, entries, floor, chosen):
    name, why = nominal.choose(installed, entries, floor)
    assert name == chosen, why
    assert why


@pytest.mark.parametrize(
    ("installed", "nominal_variant", "asked", "kept"),
    [
        (["q4-a8", "fast"], "fast", None, ["fast"]),  # a default pull: the nominal one alone
        # an exact nominal keeps the fastest candidate beside it: the ladder's cheaper rung
        (["q4", "q4-a8", "fast"], "q4", None, ["q4", "fast"]),
        (["q4", "q4-a8"], "q4", None, ["q4", "q4-a8"]),
        (["q4", "q4-a8", "fast"], "fast", ["q4", "q4-a8"], ["q4", "q4-a8", "fast"]),  # named ones beside it
        (["q4-a8", "fast"], "q4-a8", ["q4-a8", "fast"], ["q4-a8", "fast"]),
    ],
)
def test_kept(installed, nominal_variant, asked, kept):
    entries = {"q4": entry(1e-11, 0.04), "q4-a8": entry(0.002, 0.02), "fast": entry(0.002, 0.015)}
    assert nominal.kept(installed, nominal_variant, asked, entries) == kept


@pytest.mark.parametrize(
    ("installed", "entries", "floor", "needed"),
    [
        (["q4-a8", "fast"], {"q4-a8": entry(0.004), "fast": entry(0.005)}, LLAMA, True),
        (["q4-a8", "fast"], {"q4-a8": entry(0.002), "fast": entry(0.005)}, LLAMA, False),
        (["q4", "q4-a8"], {"q4": entry(0.0), "q4-a8": entry(0.004)}, LLAMA, False),  # built already
        (["q4-a8"], {"q4-a8": entry(0.004)}, None, False),  # nothing measured
    ],
)
def test_needs_exact(installed, entries, floor, needed):
    assert nominal.needs_exact(installed, entries, floor) is needed


@pytest.mark.parametrize(
    ("planned", "measure", "built"),
    [
        (["q4", "q4-a8", "fast"], True, ["q4-a8", "fast"]),
        (["q4", "q4-a8", "fast"], False, ["q4-a8"]),  # never installed unmeasured: not built
        (["f32", "q8", "q4-a8"], True, ["q4-a8"]),
    ],
)
def test_candidates(planned, measure, built):
    assert nominal.candidates(planned, measure) == built


def test_int8_floor_when_measured_then_the_int8_reference_as_it_is():
    floor = nominal.int8_floor({"kl_mean": 0.002, "kl_p99": 0.01, "method": "m"})
    assert (floor["kl_mean"], floor["kl_p99"], floor["source"]) == (0.002, 0.01, "int8 reference")
    assert floor["method"].endswith(": m")


def test_kl_when_same_or_shifted_logits_then_zero_and_positive():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 50)).astype(np.float32)
    assert np.allclose(kl_rows(a, a), 0.0)
    assert np.allclose(kl_rows(a, a + 3.0), 0.0)  # a constant shift is the same distribution
    b = a.copy()
    b[:, 0] += 4.0
    assert (kl_rows(a, b) > 0).all()


def test_q8_blocks_when_rounded_then_each_block_on_its_own_scale():
    x = np.array([[1.0] * 31 + [127.0] + [0.01] * 31 + [0.02]], np.float32)
    y = q8_blocks(x)
    assert np.array_equal(y[0, :32], x[0, :32])  # scale 1: every value is an integer already
    np.testing.assert_allclose(y[0, 32:], np.round(x[0, 32:] / (0.02 / 127)) * (0.02 / 127), rtol=1e-6)
    assert np.array_equal(q8_blocks(np.zeros((2, 64), np.float32)), np.zeros((2, 64), np.float32))


@pytest.mark.parametrize(
    ("weight_type", "block"),
    [("Q4_0", 32), ("Q4_1", 32), ("Q5_0", 32), ("Q8_0", 32), ("Q4_K", 256), ("Q6_K", 256)],
)
def test_llama_activations_when_quantized_weight_then_int8_per_its_vec_dot_block(weight_type, block):
    """llama.cpp rounds a matmul's input to Q8_0/Q8_1 beside the 32-blocks and to Q8_K (one scale per 256)
    beside the K-quants: a large value in one 32-block coarsens the others' rounding only in the latter."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 512)).astype(np.float32)
    x[:, 0] = 50.0
    got = llama_activations(x, weight_type)
    np.testing.assert_array_equal(got, q8_blocks(x, block))
    assert not np.array_equal(q8_blocks(x, 32), q8_blocks(x, 256))


def test_llama_activations_when_float_weight_then_half_or_untouched():
    x = np.array([[1.0 + 2**-12, 3.14159265, -2.5e-3, 65504.0]], np.float32)
    np.testing.assert_array_equal(llama_activations(x, "F32"), x)
    np.testing.assert_array_equal(llama_activations(x, "F16"), x.astype(np.float16).astype(np.float32))
    bf16 = llama_activations(x, "BF16")
    assert np.array_equal(bf16.view(np.uint32) & 0xFFFF, np.zeros_like(bf16, np.uint32))  # 16 bits left
    np.testing.assert_allclose(bf16, x, rtol=2**-8)
    assert bf16[0, 0] == 1.0  # nearest: 1 + 2^-12 is below half a bf16 step


def test_int8_reference_when_tiny_model_then_close_to_fp32_but_not_equal(tiny_gguf):
    ids = [1, 5, 9, 3, 7, 2]
    fp32 = ReferenceForward(GGUFModel(tiny_gguf)).logits(ids)
    int8 = ReferenceForward(GGUFModel(tiny_gguf), int8_activations=True).logits(ids)
    kl = kl_rows(fp32, int8)
    assert 0 < kl.mean() < 0.05, kl


def test_convert_when_measured_then_manifest_records_the_choice_and_the_floor(tiny_model_dir):
    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    floor = manifest["quality_floor"]
    assert floor["source"] in ("llama.cpp", "int8 reference") and floor["kl_mean"] > 0
    variants = manifest["variants"]
    assert all("kl_mean" in v["quality"] for v in variants.values())
    # the fixture names its variants, so all are kept: the rule's choice among them is the manifest's
    chosen = nominal.choose(list(variants), variants, floor)
    assert (manifest["default_variant"], manifest["default_variant_reason"]) == chosen
    genai = json.loads((tiny_model_dir / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["filename"] == manifest["variants"][chosen[0]]["file"]


def test_convert_when_only_the_exact_variant_is_asked_then_no_floor_is_measured(
    tiny_gguf, tmp_path, monkeypatch
):
    """The floor judges candidates; a pull of `q4` alone has none, and the int8 reference costs minutes on a
    slow device."""
    from models.convert import pipeline

    def no_floor(*args, **kwargs):
        raise AssertionError("the floor was measured with no candidate to judge")

    monkeypatch.setattr(pipeline, "measure_floor", no_floor)
    out = tmp_path / "out"
    out.mkdir()
    fragment = pipeline.convert(tiny_gguf, out, variants=["q4"], threads=1)
    assert fragment["quality_floor"] is None
    assert list(fragment["variants"]) == ["q4"] and fragment["default_variant"] == "q4"
    assert fragment["variants"]["q4"]["quality"]["kl_mean"] < 1e-6  # still measured: the exact variant's own
