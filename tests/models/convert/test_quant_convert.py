"""Every GGUF tensor type through the converter: a tiny GGUF per type (blocks from the format's own
reference quantizer), converted, and the exact variant's logits within 1e-4 of the fp32 numpy reference;
the int8-activation variant's top-1 agreement printed and held to a floor. Mixed-type fused projections
(llama.cpp's Q4_K_M mixes), exact embedding rows, and the pull-time error for a type we cannot map."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models.convert.graph import VARIANTS
from models.convert.model import GGUFModel
from models.convert.pipeline import convert, plan_variants
from models.convert.reference import ReferenceForward
from models.errors import UnsupportedQuantization
from models.gguf.reader import K_QUANTS, SUPPORTED_TYPES
from models.store.store import ModelStore, default_converter
from server.cli import main as cli
from server.settings import Settings
from tests.helpers import shape_of
from tests.models.convert.helpers import logits_per_position, small_logits
from tests.tiny_gguf import TinySpec, write_tiny_gguf

IDS = [5, 40, 77, 100, 3, 9, 250, 12, 30, 31, 200, 7]
TOL = 1e-4
# int8 activations (llama.cpp's arithmetic) err by 1-20 % of the logit range on these random two-layer
# models, which flips greedy choices where the top two are near ties (margins of 0.003-0.09 in
# "Q5_1-table"); a broken mapping agrees by chance (1 in 288) and does not correlate with the reference
A8_FLOOR = 0.5
A8_MIN_CORRELATION = 0.8
K_SPEC = TinySpec(hidden=256, ffn=256)  # K-quant blocks hold 256 values: inputs must be multiples of 256


def build(root: Path, **kw) -> tuple[Path, Path, dict, np.ndarray]:
    g = small_logits(write_tiny_gguf(root / "m.gguf", seed=3, **kw))
    d = root / "onnx"
    d.mkdir()
    frag = convert(g, d, measure=False, variants=kw.pop("variants", None) or plan_variants(GGUFModel(g)))
    ref = ReferenceForward(GGUFModel(g)).logits(IDS)
    return g, d, frag, np.concatenate([ref, ref[-1:]])


SOURCES = {  # name: write_tiny_gguf arguments
    **{t: {"matrix_type": t} for t in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")},
    **{t: {"matrix_type": t, "spec": K_SPEC} for t in K_QUANTS},
    # llama.cpp's Q4_K_M for Llama: attn_v and ffn_down Q6_K in some layers, an untied Q6_K head
    "llama-Q4_K_M": {
        "matrix_type": "Q4_K",
        "spec": TinySpec(hidden=256, ffn=256, tied=False),
        "embed_type": "Q4_K",
        "tensor_types": {
            "output.weight": "Q6_K",
            "blk.0.attn_v.weight": "Q6_K",
            "blk.0.ffn_down.weight": "Q6_K",
        },
    },
    # Gemma 3's Q4_K_M file: Q5_0 projections, attn_v Q8_0 or Q5_0, attn_output Q4_K, ffn_down Q6_K or
    # Q4_K per layer, a tied Q8_0 table
    "gemma-Q4_K_M": {
        "matrix_type": "Q5_0",
        "spec": K_SPEC,
        "embed_type": "Q8_0",
        "tensor_types": {
            "blk.0.attn_v.weight": "Q8_0",
            "attn_output.weight": "Q4_K",
            "blk.0.ffn_down.weight": "Q6_K",
            "blk.1.ffn_down.weight": "Q4_K",
        },
    },
    # a Q5_1 table: offsets gathered with the rows; a Q2_K head of its own
    "Q5_1-table": {
        "matrix_type": "Q3_K",
        "spec": TinySpec(hidden=256, ffn=256, tied=False),
        "embed_type": "Q5_1",
        "tensor_types": {"output.weight": "Q2_K"},
    },
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build(tmp_path_factory.mktemp(name), **SOURCES[name])
        return cache[name]

    return get


def exact_variant(frag: dict) -> str:
    return "q4" if "q4" in frag["variants"] else "f32"


@pytest.mark.parametrize("source", list(SOURCES))
def test_convert_when_source_type_then_exact_variant_matches_reference_and_a8_agrees(converted, source):
    g, d, frag, ref = converted(source)
    shape = shape_of(g)
    exact = exact_variant(frag)
    got = logits_per_position(d / f"{exact}.onnx", shape, IDS)
    err = float(np.abs(got - ref).max())
    a8 = logits_per_position(d / "q4-a8.onnx", shape, IDS)
    agree = float((a8.argmax(-1) == ref.argmax(-1)).mean())
    rel = float(np.abs(a8 - ref).max() / np.abs(ref).max())
    corr = min(float(np.corrcoef(a, r)[0, 1]) for a, r in zip(a8, ref, strict=True))
    print(
        f"{source}: {exact} max |logit - ref| {err:.1e}; q4-a8 top-1 {agree:.0%}, err {rel:.1%}, r {corr:.3f}"
    )
    assert err < TOL
    assert agree >= A8_FLOOR and corr > A8_MIN_CORRELATION


def test_exact_variant_when_mapping_is_broken_then_test_tolerance_catches_it(converted, tmp_path):
    """The tolerance above is not loose: dropping Q4_K's offset correction from one layer fails it."""
    g, d, _, ref = converted("Q4_K")
    m = onnx.load(str(d / "q4.onnx"), load_external_data=False)
    gemm = next(n for n in m.graph.node if n.op_type == "Gemm" and "attn_output" in n.input[1])
    y = gemm.input[2]
    for node in m.graph.node:
        node.input[:] = [y if x == gemm.output[0] else x for x in node.input]
    m.graph.node.remove(gemm)
    (d / "q4-broken.onnx").write_bytes(m.SerializeToString())
    got = logits_per_position(d / "q4-broken.onnx", shape_of(g), IDS)
    assert np.abs(got - ref).max() > 100 * TOL


def test_block_sums_when_the_indicator_would_be_large_then_reduce_sum_and_the_same_logits(
    tmp_path, monkeypatch
):
    """A wide input's block sums come from Reshape + ReduceSum (no indicator matrix read a call), exactly:
    forced here on the tiny Q4_K model, whose inputs are otherwise narrow enough for the indicator."""
    import models.convert.linear as linear

    monkeypatch.setattr(linear, "INDICATOR_MAX_BYTES", 0)
    g, d, _, ref = build(tmp_path, **SOURCES["Q4_K"])
    m = onnx.load(str(d / "q4.onnx"), load_external_data=False)
    assert not [i for i in m.graph.initializer if i.name.startswith("block_indicator")]
    sums = [n for n in m.graph.node if n.op_type == "ReduceSum" and n.input[0] != "attention_mask"]
    assert sums and all(
        any(s.output[0] == n.input[0] for s in sums) for n in m.graph.node if n.op_type == "Gemm"
    )
    got = logits_per_position(d / "q4.onnx", shape_of(g), IDS)
    assert np.abs(got - ref).max() < TOL


@pytest.mark.parametrize(
    ("source", "variant", "expected"),
    [
        # Q4_K q/k + Q6_K v: two layouts, two MatMulNBits and a Concat
        ("llama-Q4_K_M", "q4-a8", [("MatMulNBits", 4, 32), ("MatMulNBits", 8, 16)]),
        # in the exact variant the Q6_K part is fp32
        ("llama-Q4_K_M", "q4", [("MatMulNBits", 4, 32), ("MatMul",)]),
        # Q5_0 q/k with Q8_0 v: one 8-bit layout, one node
        ("gemma-Q4_K_M", "q4-a8", [("MatMulNBits", 8, 32)]),
        ("gemma-Q4_K_M", "q4", [("MatMul",)]),
    ],
)
def test_fused_qkv_when_types_mix_then_one_node_per_layout(converted, source, variant, expected):
    _, d, _, _ = converted(source)
    m = onnx.load(str(d / f"{variant}.onnx"), load_external_data=False)
    inits = {t.name for t in m.graph.initializer}
    # the nodes that read the first layer's normed input and a blk.0.attn_qkv weight
    nodes = [
        n
        for n in m.graph.node
        if any(i.startswith("blk.0.attn_qkv") and i in inits for i in n.input) and n.op_type != "Gemm"
    ]
    got = []
    for n in nodes:
        attrs = {a.name: a.i for a in n.attribute}
        got.append(
            (n.op_type, attrs["bits"], attrs["block_size"]) if n.op_type == "MatMulNBits" else (n.op_type,)
        )
    assert got == expected
    # what GroupQueryAttention gets (through the Reshape to 3-D): a Concat of the parts, or the one part
    gqa = next(n for n in m.graph.node if n.op_type == "GroupQueryAttention")
    to_seq = next(n for n in m.graph.node if gqa.input[0] in n.output)
    assert to_seq.op_type == "Reshape"
    qkv = to_seq.input[0]
    producer = next(n for n in m.graph.node if qkv in n.output)
    assert (producer.op_type == "Concat") == (len(expected) > 1)


@pytest.mark.parametrize("source", ["Q4_1", "Q4_K", "Q2_K", "Q6_K", "Q5_1-table", "Q3_K"])
def test_embedding_lookup_when_block_table_then_rows_are_ggmls_bit_for_bit(converted, source):
    """The gathered rows (before any layer) equal the dequantized table exactly: codes, zero point, scale
    and offset as GGML computes them."""
    g, d, _, _ = converted(source)
    m = onnx.load(str(d / "q4.onnx"))
    x = next(n for n in m.graph.node if n.op_type == "Reshape" and n.input[1] == "to_2d").output[0]
    m.graph.output.append(onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None))
    (d / "q4-rows.onnx").write_bytes(m.SerializeToString())
    sess = ort.InferenceSession(str(d / "q4-rows.onnx"), providers=["CPUExecutionProvider"])
    shape = shape_of(g)
    feeds = {"input_ids": np.array([IDS], np.int64), "attention_mask": np.ones((1, len(IDS)), np.int64)}
    for i in range(shape.n_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros(
                (1, shape.n_kv_heads, 0, shape.head_dim), np.float32
            )
    rows = sess.run([x], feeds)[0]
    table = GGUFModel(g).tensor("token_embd.weight")
    assert table.type_name != "F32"
    want = table.dequantize()[IDS]
    assert rows.tobytes() == want.tobytes()


def test_lookup_and_head_when_tied_8bit_table_then_one_copy_of_the_codes(converted):
    """Gemma's layout: the int8 variant's head and every variant's lookup read the same bytes."""
    _, d, _, _ = converted("gemma-Q4_K_M")
    ext = {}
    for v in ("q4", "q4-a8"):
        m = onnx.load(str(d / f"{v}.onnx"), load_external_data=False)
        ext[v] = {t.name: {e.key: e.value for e in t.external_data} for t in m.graph.initializer}
    same = ext["q4-a8"]["token_embd.qweight"]
    assert ext["q4-a8"]["token_embd.gather_qweight"] == same == ext["q4"]["token_embd.gather_qweight"]
    assert "token_embd.qweight" not in ext["q4"]  # the exact head is a nibble pair of its own
    assert ext["q4-a8"]["token_embd.gather_scales"]["offset"] == ext["q4-a8"]["token_embd.scales"]["offset"]


def test_manifest_when_converted_then_quant_map_per_variant_and_type(converted):
    _, _, frag, _ = converted("gemma-Q4_K_M")
    q4, a8 = frag["variants"]["q4"]["quant_map"], frag["variants"]["q4-a8"]["quant_map"]
    assert set(q4) == set(a8) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert "8-bit block 16, exact" in a8["Q6_K"] and "fp32 MatMul" in q4["Q6_K"]
    assert "4-bit block 32 + offset correction, exact" in q4["Q4_K"]
    assert "nibble pair" in q4["Q8_0"] and "lookup: 8-bit rows gathered, exact" in q4["Q8_0"]
    json.dumps(frag)  # the manifest is JSON


def test_float_source_when_int8_variant_then_quant_map_says_not_exact(converted):
    _, _, frag, _ = converted("BF16")
    assert set(frag["variants"]) == {"f32", "q8", "q4-a8"}
    assert "not exact" in frag["variants"]["q4-a8"]["quant_map"]["BF16"]


# -- a type we cannot map: a clear error at pull time, nothing installed -----------------------------------


@pytest.fixture
def iq4_gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(
        tmp_path / "Tiny-IQ4.gguf", matrix_type="Q4_0", tensor_types={"ffn_up.weight": "IQ4_NL"}
    )


def test_pull_when_iq4_nl_tensor_then_unsupported_quantization_and_nothing_installed(tmp_path, iq4_gguf):
    store = ModelStore(tmp_path / "home", converter=default_converter())
    with pytest.raises(UnsupportedQuantization) as e:
        store.pull(str(iq4_gguf))
    msg = e.value.message
    assert "tensor blk.0.ffn_up.weight is quantized as IQ4_NL" in msg
    assert all(t in msg for t in SUPPORTED_TYPES.values())
    assert store.list() == []
    model_dir = tmp_path / "home" / "models" / "tiny-iq4"
    assert not model_dir.exists() or not any(model_dir.iterdir())
    assert e.value.code == "unsupported_quantization"


def test_cli_pull_when_iq4_nl_tensor_then_exit_1_with_the_message(tmp_path, iq4_gguf, capsys):
    settings = Settings(home=tmp_path / "home")
    assert cli.main(["pull", str(iq4_gguf)], settings=settings, converter=default_converter()) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: Tiny-IQ4.gguf: tensor blk.0.ffn_up.weight is quantized as IQ4_NL")
    assert "supported: F32, F16, BF16, Q4_0" in err


def test_variants_when_listed_then_the_names_the_governor_knows():
    assert set(VARIANTS) == {"f32", "q8", "q4", "q4-a8", "fast"}
