"""The GGUF -> ONNX converter against an independent numpy reference (tests/reference_llama.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from models.convert.graph import VARIANTS
from models.convert.model import GGUFModel
from models.convert.pipeline import convert, plan_variants, smoke_test
from models.errors import InvalidModelFile, UnsupportedModel, UnsupportedQuantization, VerificationFailed
from models.gguf.quant import pack_tensor, q8_as_nibble_pair
from models.runtime.session import DecoderSession, KVCache, ModelShape
from tests.helpers import shape_of
from tests.reference_llama import ReferenceLlama
from tests.tiny_gguf import write_tiny_gguf

IDS = [5, 40, 77, 100, 3, 9, 250, 12, 30, 31, 200, 7]
TOL = 2e-4  # fp32 activations: the graph and the reference differ only by summation order


def run_steps(sess: DecoderSession, shape: ModelShape, ids: list[int], chunks: list[int]) -> list[np.ndarray]:
    """Feed ids in the given chunk sizes; returns the last-position logits after each chunk."""
    kv = KVCache(shape, 64)
    out, pos = [], 0
    for n in chunks:
        out.append(sess.run(np.array(ids[pos : pos + n]), kv, pos).copy())
        pos += n
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """matrix type -> (gguf path, converted dir, fragment), converted without timing measurements."""
    out = {}
    for mtype, etype in (("F32", None), ("F16", None), ("Q8_0", None), ("Q4_1", "Q8_0"), ("Q4_0", "F32")):
        root = tmp_path_factory.mktemp(f"conv-{mtype}")
        g = write_tiny_gguf(root / "m.gguf", matrix_type=mtype, embed_type=etype, seed=3)
        d = root / "onnx"
        d.mkdir()
        out[mtype] = (g, d, convert(g, d, measure=False, variants=list(VARIANTS)))
    return out


EXACT = [  # (source matrix type, variant) pairs that must match the fp32 reference tightly
    ("F32", "f32"),
    ("F16", "f32"),
    ("Q8_0", "f32"),
    ("Q8_0", "q4"),
    ("Q4_1", "f32"),
    ("Q4_1", "q4"),
    ("Q4_0", "f32"),
    ("Q4_0", "q4"),
]


@pytest.mark.parametrize(("mtype", "variant"), EXACT)
def test_convert_when_fp32_activations_then_logits_match_reference(converted, mtype, variant):
    g, d, _ = converted[mtype]
    ref = ReferenceLlama(g).logits(IDS)
    shape = shape_of(g)
    sess = DecoderSession(d / f"{variant}.onnx", shape, 1)
    (full,) = run_steps(sess, shape, IDS, [len(IDS)])
    assert np.abs(full - ref[-1]).max() < TOL


@pytest.mark.parametrize("mtype", ["F32", "Q4_1"])
def test_decode_when_kv_cache_then_equals_full_recompute(converted, mtype):
    g, d, _ = converted[mtype]
    ref = ReferenceLlama(g).logits(IDS)
    shape = shape_of(g)
    variant = "q4" if mtype == "Q4_1" else "f32"
    sess = DecoderSession(d / f"{variant}.onnx", shape, 1)
    steps = run_steps(sess, shape, IDS, [1] * len(IDS))
    for pos, logits in enumerate(steps):
        assert np.abs(logits - ref[pos]).max() < TOL, f"position {pos}"


def test_prefill_when_chunked_then_equals_one_shot(converted):
    g, d, _ = converted["Q4_1"]
    shape = shape_of(g)
    sess = DecoderSession(d / "q4.onnx", shape, 1)
    (one,) = run_steps(sess, shape, IDS, [len(IDS)])
    chunked = run_steps(sess, shape, IDS, [5, 4, 3])[-1]
    assert np.abs(one - chunked).max() < 1e-5


def test_rope_when_pairing_is_wrong_then_logits_disagree(converted, tmp_path):
    """The test above would catch a converter that got the Q/K permutation wrong: flip the pairing."""
    g, d, _ = converted["F32"]
    model = onnx.load(str(d / "f32.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            for a in node.attribute:
                if a.name == "rotary_interleaved":
                    a.i = 0
    (d / "f32-wrong-rope.onnx").write_bytes(model.SerializeToString())
    shape = shape_of(g)
    sess = DecoderSession(d / "f32-wrong-rope.onnx", shape, 1)
    (full,) = run_steps(sess, shape, IDS, [len(IDS)])
    ref = ReferenceLlama(g).logits(IDS)
    assert np.abs(full - ref[-1]).max() > 100 * TOL


@pytest.mark.parametrize(("mtype", "variant"), [("Q4_1", "q4-a8"), ("Q8_0", "q8"), ("Q4_1", "q8")])
def test_convert_when_int8_activations_then_close_and_same_top1(converted, mtype, variant):
    g, d, _ = converted[mtype]
    ref = ReferenceLlama(g).logits(IDS)
    shape = shape_of(g)
    sess = DecoderSession(d / f"{variant}.onnx", shape, 1)
    (full,) = run_steps(sess, shape, IDS, [len(IDS)])
    scale = np.abs(ref[-1]).max()
    assert np.abs(full - ref[-1]).max() < 0.1 * scale
    assert full.argmax() == ref[-1].argmax()


def test_plan_when_quantized_source_then_exact_and_int8_and_when_float_then_f32_and_requantized(converted):
    assert plan_variants(GGUFModel(converted["Q4_1"][0])) == ["q4", "q4-a8", "fast"]
    assert plan_variants(GGUFModel(converted["Q8_0"][0])) == ["q4", "q4-a8", "fast"]
    assert plan_variants(GGUFModel(converted["Q4_0"][0])) == [
        "q4",
        "q4-a8",
        "fast",
    ]  # its F32 embedding aside
    assert plan_variants(GGUFModel(converted["F16"][0])) == ["f32", "q8", "q4-a8"]


def _external(t: onnx.TensorProto) -> tuple[str, str, str]:
    info = {e.key: e.value for e in t.external_data}
    return info["location"], info["offset"], info["length"]


@pytest.mark.parametrize(
    ("mtype", "variant", "head"),
    [
        ("Q4_1", "q4-a8", "token_embd.qweight"),
        ("Q8_0", "q8", "token_embd.qweight"),
        ("Q4_1", "q4", "token_embd.qweight"),  # the head is a nibble pair: the table is the lookup's alone
        ("Q4_0", "f32", "token_embd.weight"),
    ],
)
def test_embedding_lookup_when_tied_then_own_initializer_over_the_head_bytes(converted, mtype, variant, head):
    """The lookup and the LM head must not share one initializer (the head's is unmapped after prepacking,
    a shared one stays resident in full), yet the table must be written once."""
    _, d, _ = converted[mtype]
    m = onnx.load(d / f"{variant}.onnx", load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    lookup = next(n for n in m.graph.node if n.input[0].startswith("token_embd.gather_"))
    table = lookup.input[0]
    assert table != head
    readers = {n.op_type for n in m.graph.node if table in n.input}
    assert readers == {lookup.op_type}
    head_bytes = inits.get(head)
    if head_bytes is None:  # not in this graph: the bytes the other variants' heads use
        other = onnx.load(d / "q4-a8.onnx", load_external_data=False)
        head_bytes = {t.name: t for t in other.graph.initializer}[head]
    assert _external(inits[table]) == _external(head_bytes)


def test_embedding_lookup_when_q8_0_table_then_8bit_rows_for_fp32_variants_too(converted):
    _, d, _ = converted["Q4_1"]  # Q4_1 matrices, Q8_0 embedding
    m = onnx.load(d / "q4.onnx", load_external_data=False)
    assert any(n.op_type == "GatherBlockQuantized" for n in m.graph.node)


def test_q8_head_as_nibble_pair_when_dequantized_then_exactly_the_q8_values(converted):
    g, _, _ = converted["Q4_1"]  # its embedding (the tied head) is Q8_0
    t = GGUFModel(g).tensor("token_embd.weight")
    p = q8_as_nibble_pair(pack_tensor(t))
    lo_nib = (p.packed & 15).astype(np.float32)
    hi_nib = (p.packed >> 4).astype(np.float32)
    q = np.stack([lo_nib, hi_nib], axis=-1).reshape(p.n, p.k // 32, 32)  # element 2i low, 2i+1 high
    zp = np.stack([p.zero_points & 15, p.zero_points >> 4], axis=-1).reshape(p.n, -1)[:, : p.k // 32]
    w = ((q - zp[..., None]) * p.scales[..., None]).reshape(p.n, 2, p.k // 2).sum(axis=1)
    assert np.array_equal(w, t.dequantize())


def test_q4_variant_when_q8_head_then_no_fp32_head_table(converted):
    _, d, _ = converted["Q4_1"]
    m = onnx.load(d / "q4.onnx", load_external_data=False)
    names = {t.name for t in m.graph.initializer}
    assert "token_embd.weight" not in names and "lm_head.q8pair.qweight" in names
    assert "lm_head.weight_t" not in names


def test_convert_writes_genai_config_tokenizer_and_template(converted):
    _, d, frag = converted["Q4_1"]
    cfg = json.loads((d / "genai_config.json").read_text())
    assert cfg["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert cfg["model"]["decoder"]["filename"] in {f"{v}.onnx" for v in frag["variants"]}
    assert (d / "tokenizer.json").exists()
    assert "im_start" in (d / "chat_template.jinja").read_text()
    for name, entry in frag["variants"].items():
        assert entry["weights_bytes"] > 0, name


def test_manifest_when_measured_then_quality_and_speed_recorded(tiny_model_dir):
    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    for name, entry in manifest["variants"].items():
        assert 0.0 <= entry["quality"]["top1_agreement"] <= 1.0, name
        assert entry["speed"]["decode_tok_s"] > 0, name
        assert entry["speed"]["cpu_s_per_token"] > 0, name
    assert manifest["variants"]["q4"]["quality"]["max_logit_error"] < TOL
    smoke_test(tiny_model_dir, manifest)


def test_smoke_when_quality_too_low_then_verification_fails(tiny_model_dir):
    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    manifest["variants"]["q4"]["quality"]["top1_agreement"] = 0.2
    with pytest.raises(VerificationFailed, match="q4"):
        smoke_test(tiny_model_dir, manifest)


# -- bad input ---------------------------------------------------------------------------------------


def test_convert_when_not_gguf_then_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(InvalidModelFile, match="not a GGUF"):
        convert(bad, tmp_path / "out")


def test_convert_when_truncated_then_clear_error(tmp_path):
    g = write_tiny_gguf(tmp_path / "m.gguf")
    data = g.read_bytes()
    g.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(InvalidModelFile, match="truncated"):
        convert(g, tmp_path / "out")


def test_convert_when_unsupported_architecture_then_clear_error(tmp_path):
    g = write_tiny_gguf(tmp_path / "m.gguf", architecture="mamba")
    with pytest.raises(UnsupportedModel, match="architecture 'mamba'"):
        convert(g, tmp_path / "out")


def test_convert_when_unsupported_tensor_type_then_clear_error(tmp_path):
    g = write_tiny_gguf(tmp_path / "m.gguf", matrix_type="IQ4_NL")
    with pytest.raises(UnsupportedQuantization, match=r"tensor \S+ is quantized as IQ4_NL") as e:
        convert(g, tmp_path / "out")
    assert e.value.code == "unsupported_quantization" and "Q4_K" in e.value.message


def test_prefix_reuse_when_kv_prefix_kept_then_same_logits_as_full_prefill(converted):
    """What the engine's prefix cache relies on: keeping positions 0..n-1 of another sequence's KV and
    prefilling only the rest gives the logits of a fresh full prefill."""
    g, d, _ = converted["Q4_1"]
    shape = shape_of(g)
    sess = DecoderSession(d / "q4.onnx", shape, 1)
    other = [*IDS[:7], 200, 201, 202, 203]
    target = IDS
    kv = KVCache(shape, 64)
    sess.run(np.array(other), kv, 0)  # the cache now holds `other`
    reused = sess.run(np.array(target[7:]), kv, 7).copy()  # keep the 7 shared positions
    (fresh,) = run_steps(sess, shape, target, [len(target)])
    assert np.abs(reused - fresh).max() < 1e-5
