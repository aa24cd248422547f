"""GGML block formats decoded and packed for onnxruntime without re-quantizing: every value bit-for-bit
GGML's dequantization (gguf.quants.dequantize), through each layout the converter uses."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from models.convert.graph import Planned, WeightFile
from models.gguf.blocks import FORMATS
from models.gguf.quant import (
    Layout,
    PackedNBits,
    Packing,
    as_nibble_pair,
    concat_packed,
    pack_tensor,
    packing,
    split_blocks,
    widen,
)
from models.gguf.reader import SUPPORTED_TYPES, Tensor
from tests.ggml_quantize import K_QUANTIZERS, quantize

BLOCK_TYPES = list(FORMATS)
ALL_TYPES = list(SUPPORTED_TYPES.values())


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal float32 arrays (NaN payloads aside: random bytes make NaN scales too)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(
        ((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all()
    )


def random_tensor(type_name: str, rows: int = 6, blocks_per_row: int = 3, seed: int = 0) -> Tensor:
    """Random bytes: every bit pattern a block can hold, scales included."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16"):
        dt = np.float32 if type_name == "F32" else np.float16
        data = rng.standard_normal((rows, block * blocks_per_row * 8)).astype(dt)
        return Tensor("t", type_name, rows, data.shape[1], data)
    data = rng.integers(0, 256, (rows, blocks_per_row * size), dtype=np.uint8)
    return Tensor("t", type_name, rows, blocks_per_row * block, data)


def ggml(t: Tensor) -> np.ndarray:
    return dequantize(t.data, GGMLQuantizationType[t.type_name]).reshape(t.rows, t.cols)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_dequantize_when_any_supported_type_then_bit_for_bit_ggml(type_name):
    t = random_tensor(type_name)
    assert same_bits(t.dequantize(), ggml(t))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_pack_when_block_type_then_codes_scales_offsets_are_ggmls(type_name):
    """What MatMulNBits and GatherBlockQuantized get (codes under the default zero point, the shift, the
    block's scale and offset) decodes to GGML's values exactly, at the format's own width and block."""
    t = random_tensor(type_name)
    p = pack_tensor(t)
    fmt = FORMATS[type_name]
    assert (p.bits, p.block) == (fmt.bits, fmt.block)
    assert (p.offsets is not None) == fmt.has_offset
    assert p.packed.shape == (t.rows, t.cols // fmt.block, fmt.block * fmt.bits // 8)
    assert same_bits(p.dequantize(), ggml(t))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("type_name", [n for n in BLOCK_TYPES if FORMATS[n].bits == 4])
def test_widen_when_4bit_codes_then_8bit_codes_of_the_same_values(type_name):
    t = random_tensor(type_name)
    p4 = pack_tensor(t)
    p8 = widen(p4)
    assert p8.bits == 8 and (p8.shift is None) == (p4.shift is None)
    assert same_bits(p8.dequantize(), ggml(t))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("type_name", [n for n in BLOCK_TYPES if FORMATS[n].block == 32])
def test_split_blocks_when_32_to_16_then_same_values(type_name):
    t = random_tensor(type_name)
    p = split_blocks(pack_tensor(t), 16)
    assert p.block == 16 and p.scales.shape == (t.rows, t.cols // 16)
    assert same_bits(p.dequantize(), ggml(t))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_concat_when_parts_with_and_without_offsets_then_each_part_keeps_its_values():
    a, b = random_tensor("Q4_1", seed=1), random_tensor("Q4_0", rows=4, seed=2)
    fused = concat_packed([pack_tensor(a), pack_tensor(b)])
    w = fused.dequantize()
    assert same_bits(w[: a.rows], ggml(a))
    assert np.array_equal(w[a.rows :], ggml(b), equal_nan=True)  # + a zero offset: -0.0 reads as 0.0
    assert fused.correction.shape == (a.cols // 32, a.rows + b.rows)
    assert not fused.correction[:, a.rows :].any()  # Q4_0 needs none


def test_concat_when_layouts_differ_then_refused():
    with pytest.raises(ValueError, match="layouts"):
        concat_packed([pack_tensor(random_tensor("Q4_K")), pack_tensor(random_tensor("Q6_K"))])


@pytest.mark.parametrize("type_name", [n for n in BLOCK_TYPES if FORMATS[n].bits == 8])
def test_nibble_pair_when_8bit_codes_then_two_4bit_halves_make_the_same_matrix(type_name):
    """hi and lo halves with scales 16s and s over the input twice: (hi - 8) * 16s + lo * s = q * s."""
    rng = np.random.default_rng(0)
    t = Tensor("t", type_name, 5, 256, quantize(rng.standard_normal((5, 256)), type_name))
    p8 = pack_tensor(t)
    pair = as_nibble_pair(p8)
    assert (pair.bits, pair.k, pair.block) == (4, 2 * p8.k, p8.block)
    halves = pair.dequantize().reshape(t.rows, 2, t.cols).astype(np.float64)
    w = halves.sum(axis=1)
    if p8.correction is not None:  # the min, and the centring of Q5_1/Q5_K codes
        w = w + np.repeat(p8.correction.T, p8.block, axis=1)
    # each half is an exact product; their float64 sum differs from GGML's single fp32 product by its rounding
    np.testing.assert_allclose(w, ggml(t), rtol=2**-22, atol=0)


def test_pack_when_narrower_than_the_format_then_refused():
    with pytest.raises(ValueError, match="cannot pack"):
        pack_tensor(random_tensor("Q8_0"), 4)


# -- the K-quant reference quantizers the tests use --------------------------------------------------------


def _libggml() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib = Path(spec.origin).parent / "lib" / "libggml-base.so"
    return lib if lib.exists() else None


@pytest.mark.skipif(_libggml() is None, reason="llama-cpp-python (libggml) is not installed")
@pytest.mark.parametrize("type_name", list(K_QUANTIZERS))
def test_k_quantizer_port_when_compared_with_libggml_then_identical_blocks(type_name):
    """The numpy port of quantize_row_q*_K_ref against ggml's own C, on three kinds of rows."""
    lib = ctypes.CDLL(str(_libggml()))
    fn = getattr(lib, f"quantize_row_{type_name[:2].lower()}_K_ref")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((48, 512)).astype(np.float32)
    x[::4] = x[::4] ** 3  # heavy tails
    x[1::5] *= 1e-3
    x[2::7] = 0.0
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    out = np.zeros(x.size // 256 * size, np.uint8)
    fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    assert np.array_equal(K_QUANTIZERS[type_name](x).reshape(-1), out)


# -- layouts: what the converter plans from the header is what packing produces ----------------------------


def _arrays(p: PackedNBits) -> dict[str, tuple]:
    shapes = {"packed": p.packed.shape, "scales": p.scales.shape}
    if p.zero_points is not None:
        shapes["zero_points"] = p.zero_points.shape
    if p.correction is not None:
        shapes["correction"] = p.correction.shape
    return shapes


def _planned(lay: Layout) -> dict[str, tuple]:
    shapes = {"packed": lay.packed_shape, "scales": lay.scales_shape}
    if lay.zero_points:
        shapes["zero_points"] = lay.zero_points_shape
    if lay.correction:
        shapes["correction"] = lay.correction_shape
    return shapes


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_layout_when_planned_from_type_and_shape_then_every_packing_matches(type_name):
    """Layout (from the header) against PackedNBits (from the bytes), through each transformation the
    converter applies: the disk plan's sizes and the graph's shapes rest on this."""
    t = random_tensor(type_name, blocks_per_row=16 if type_name in FORMATS else 64)
    floats = type_name not in FORMATS
    cases = []
    for bits in (4, 8) if floats else (None,):
        pl = packing(t, bits)
        p = pl.get()
        cases.append((pl.layout, p))
        if not floats:
            cases += [(pl.layout.widened(), widen(p)), (pl.layout.split(16), split_blocks(p, 16))]
        if p.bits == 8 or not floats:
            p8 = widen(p)
            cases.append((pl.layout.widened().nibble_pair(), as_nibble_pair(p8)))
        cases.append((Layout.concat([pl.layout, pl.layout]), concat_packed([p, p])))
    for lay, p in cases:
        assert p.layout == lay
        assert _arrays(p) == _planned(lay)


def test_packing_when_computed_codes_differ_from_the_plan_then_converter_bug(tmp_path):
    t = random_tensor("Q4_K", blocks_per_row=1)
    wrong = Packing(Layout.of("Q4_K", t.rows, t.cols).widened(), lambda lo, hi: pack_tensor(t))
    with pytest.raises(RuntimeError, match="converter bug"):
        wrong.get()


def test_weight_file_when_computed_array_differs_from_the_plan_then_converter_bug(tmp_path):
    w = WeightFile(tmp_path / "w.data")
    w.add("ok", Planned((2, 3), np.float32, lambda: np.zeros((2, 3), np.float32)))
    with pytest.raises(RuntimeError, match="converter bug: bad planned as"):
        w.add("bad", Planned((2, 3), np.float32, lambda: np.zeros((3, 2), np.float32)))
    w.close()


def test_weight_file_when_dry_then_same_offsets_as_a_real_one(tmp_path):
    arrays = {"a": np.ones(5, np.uint8), "b": np.ones((3, 7), np.float32), "c": np.ones(1, np.float32)}
    real, dry = WeightFile(tmp_path / "w.data"), WeightFile(tmp_path / "w.data", dry=True)
    for name, a in arrays.items():
        planned = Planned(a.shape, a.dtype.type, lambda a=a: a)
        assert real.add(name, planned) == dry.add(name, planned)
    real.close()
    dry.close()
    assert dry.size == real.size == (tmp_path / "w.data").stat().st_size
