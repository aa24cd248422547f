"""Every architecture family, converted from a tiny synthetic GGUF (tests/tiny_gguf.py) and checked against
the numpy reference (models/convert/reference.py), which is itself checked against llama.cpp on the same
files when llama-cpp-python is installed."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import onnx
import pytest

from models.convert.families import FAMILIES
from models.convert.model import GGUFModel
from models.convert.pipeline import convert
from models.convert.reference import ReferenceForward
from models.errors import UnsupportedArchitecture, UnsupportedModel
from models.gguf.reader import SUPPORTED_TYPES
from models.runtime.session import DecoderSession, KVCache, ModelShape
from server.cli import main as cli
from server.settings import Settings
from tests.helpers import shape_of
from tests.models.convert.helpers import small_logits
from tests.tiny_gguf import FAMILY_SPECS, TinySpec, write_tiny_gguf

TINY = ["llama", "llama3", "qwen2", "qwen3", "gemma3"]
# 20 positions: more than twice gemma3's tiny sliding window (8), so layers 0-4 really drop old keys
IDS = [int(x) for x in np.random.default_rng(1).integers(3, 290, 20)]
TOL = 1e-4  # fp32 activations: the graph and the reference differ only by summation order
EXACT = ["f32", "q4"]  # Q4_0 matrices and a Q8_0 embedding map exactly onto both


@pytest.fixture(scope="module")
def tiny_families(tmp_path_factory):
    """family -> (gguf, converted folder, manifest fragment): Q4_0 matrices, Q8_0 embedding."""
    out = {}
    for fam in TINY:
        root = tmp_path_factory.mktemp(f"fam-{fam}")
        g = write_tiny_gguf(root / "m.gguf", family=fam, matrix_type="Q4_0", embed_type="Q8_0", seed=3)
        d = root / "onnx"
        d.mkdir()
        # f32 too (a quantized source's plan has q4 as its exact variant): both exact routes are checked
        out[fam] = (g, d, convert(g, d, measure=False, variants=["f32", "q4", "q4-a8"]))
    return out


@pytest.fixture(scope="module")
def references(tiny_families):
    return {fam: ReferenceForward(GGUFModel(g)).logits(IDS) for fam, (g, _, _) in tiny_families.items()}


def run_chunks(sess: DecoderSession, shape: ModelShape, chunks: list[int]) -> list[np.ndarray]:
    """Feed IDS in chunks through one shared KV buffer; the last position's logits after each chunk."""
    kv = KVCache(shape, 48)
    out, pos = [], 0
    for n in chunks:
        out.append(sess.run(np.array(IDS[pos : pos + n]), kv, pos).copy())
        pos += n
    return out


@pytest.mark.parametrize("variant", EXACT)
@pytest.mark.parametrize("family", TINY)
def test_family_when_prefill_then_logits_match_reference(tiny_families, references, family, variant):
    g, d, _ = tiny_families[family]
    shape = shape_of(GGUFModel(g))
    sess = DecoderSession(d / f"{variant}.onnx", shape, 1)
    ref = references[family]
    for n in (5, 9, 20):  # inside, just past, and far past the tiny window
        (logits,) = run_chunks(sess, shape, [n])
        assert np.abs(logits - ref[n - 1]).max() < TOL, f"{family}/{variant} prefill of {n}"


@pytest.mark.parametrize("variant", EXACT)
@pytest.mark.parametrize("family", TINY)
def test_family_when_decoding_token_by_token_then_logits_match_reference(
    tiny_families, references, family, variant
):
    """The shared KV buffer across decode steps, past the sliding window."""
    g, d, _ = tiny_families[family]
    shape = shape_of(GGUFModel(g))
    sess = DecoderSession(d / f"{variant}.onnx", shape, 1)
    steps = run_chunks(sess, shape, [1] * len(IDS))
    errors = [float(np.abs(logits - references[family][pos]).max()) for pos, logits in enumerate(steps)]
    assert max(errors) < TOL, f"{family}/{variant}: errors by position {errors}"


@pytest.mark.parametrize("variant", EXACT)
@pytest.mark.parametrize("family", TINY)
def test_family_when_rows_decode_as_one_batch_then_each_row_matches_reference(
    tiny_families, references, family, variant
):
    """A pass of three rows, each its own sequence at its own position over its own past (one inside the
    tiny sliding window, two past it): each row's logits are the reference's at that position."""
    from models.runtime.batch import BatchKV, BatchPass

    g, d, _ = tiny_families[family]
    shape = shape_of(GGUFModel(g))
    sess = DecoderSession(d / f"{variant}.onnx", shape, 1)
    lengths = [5, 19, 12]
    kv = BatchKV(shape, len(lengths), 48)
    for row, n in zip(kv.rows, lengths, strict=True):
        sess.run(np.array(IDS[:n]), row, 0)
    logits = BatchPass(sess, kv).run(np.array([IDS[n] for n in lengths]), np.array(lengths) + 1)
    for b, n in enumerate(lengths):
        assert np.abs(logits[b] - references[family][n]).max() < TOL, f"{family}/{variant} row {b}"


@pytest.mark.parametrize("family", TINY)
def test_family_when_prefill_is_chunked_across_the_window_then_same_logits(tiny_families, references, family):
    g, d, _ = tiny_families[family]
    shape = shape_of(GGUFModel(g))
    sess = DecoderSession(d / "q4.onnx", shape, 1)
    steps = run_chunks(sess, shape, [6, 7, 7])
    for end, logits in zip((6, 13, 20), steps, strict=True):
        assert np.abs(logits - references[family][end - 1]).max() < TOL


@pytest.mark.parametrize("family", TINY)
def test_family_when_int8_activations_then_top1_mostly_agrees(
    tiny_families, references, family, record_property
):
    g, d, _ = tiny_families[family]
    shape = shape_of(GGUFModel(g))
    sess = DecoderSession(d / "q4-a8.onnx", shape, 1)
    steps = run_chunks(sess, shape, [1] * len(IDS))
    agree = float(np.mean([s.argmax() == r.argmax() for s, r in zip(steps, references[family], strict=True)]))
    record_property("q4_a8_top1_agreement", agree)
    assert agree >= 0.75, f"{family}: q4-a8 agrees with the reference on {agree:.0%} of positions"


# every mapped type in one file per family: layer 0 and 1 spread the 13 types over the seven projections (so
# fused projections mix layouts too), the tied table (or the untied head) is a K-quant of its own
EVERY_TYPE = {
    "output.weight": "Q2_K",  # first: a suffix of attn_output's names too, which the later keys override
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_1",
    "blk.0.attn_v.weight": "Q5_0",
    "blk.0.attn_output.weight": "Q5_1",
    "blk.0.ffn_gate.weight": "Q8_0",
    "blk.0.ffn_up.weight": "Q2_K",
    "blk.0.ffn_down.weight": "Q3_K",
    "blk.1.attn_q.weight": "Q5_K",
    "blk.1.attn_k.weight": "Q6_K",
    "blk.1.attn_v.weight": "F16",
    "blk.1.attn_output.weight": "BF16",
    "blk.1.ffn_gate.weight": "F32",
    "blk.1.ffn_up.weight": "Q4_K",
}


@pytest.mark.parametrize("family", TINY)
def test_family_when_every_quant_type_then_exact_variant_matches_reference(tmp_path, family, record_property):
    """Per family x per GGUF type: the exact variant within TOL of the reference, q4-a8's top-1 recorded."""
    base = FAMILY_SPECS[family]
    # K-quant rows hold whole 256-value blocks: every input size (hidden, heads x head_dim, ffn) is 256
    spec = replace(base, hidden=256, ffn=256, head_dim=64 if base.head_dim else None)
    g = small_logits(
        write_tiny_gguf(
            tmp_path / "m.gguf",
            family=family,
            spec=spec,
            matrix_type="Q4_K",
            embed_type="Q5_K",
            tensor_types=EVERY_TYPE,
            seed=3,
        )
    )
    model = GGUFModel(g)
    assert set(SUPPORTED_TYPES.values()) - set(model.tensor_types()) == set()
    d = tmp_path / "onnx"
    d.mkdir()
    frag = convert(g, d, measure=False, variants=["q4", "q4-a8"])
    assert list(frag["variants"]) == ["q4", "q4-a8"]
    shape, ref = shape_of(model), ReferenceForward(model).logits(IDS)
    exact = run_chunks(DecoderSession(d / "q4.onnx", shape, 1), shape, [1] * len(IDS))
    errors = [float(np.abs(logits - ref[pos]).max()) for pos, logits in enumerate(exact)]
    assert max(errors) < TOL, f"{family}: errors by position {errors}"
    a8 = run_chunks(DecoderSession(d / "q4-a8.onnx", shape, 1), shape, [1] * len(IDS))
    agree = float(np.mean([s.argmax() == r.argmax() for s, r in zip(a8, ref, strict=True)]))
    record_property("q4_a8_top1_agreement", agree)
    print(
        f"{family}, every type: q4 max |logit - ref| {max(errors):.1e} (logits up to "
        f"{np.abs(ref).max():.1f}); q4-a8 top-1 {agree:.0%}"
    )
    assert agree >= 0.5


def _with_attribute(d, variant: str, name: str, value: int | None):
    """A copy of a variant with one GroupQueryAttention attribute changed (None: removed) on every node."""
    model = onnx.load(str(d / f"{variant}.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            keep = [a for a in node.attribute if a.name != name]
            del node.attribute[:]
            node.attribute.extend(keep)
            if value is not None:
                node.attribute.append(onnx.helper.make_attribute(name, value))
    path = d / f"{variant}-{name}-{value}.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("family", TINY)
def test_family_when_rope_pairing_is_flipped_then_logits_disagree(tiny_families, references, family):
    """The tests above can tell interleaved from NEOX RoPE for every family."""
    g, d, _ = tiny_families[family]
    flipped = 0 if GGUFModel(g).family.rope_interleaved else 1
    shape = shape_of(GGUFModel(g))
    sess = DecoderSession(_with_attribute(d, "f32", "rotary_interleaved", flipped), shape, 1)
    (logits,) = run_chunks(sess, shape, [len(IDS)])
    assert np.abs(logits - references[family][-1]).max() > 100 * TOL


def test_gemma3_when_window_removed_then_logits_disagree(tiny_families, references):
    """The sliding window is really exercised by these positions (and only sliding layers have one)."""
    g, d, _ = tiny_families["gemma3"]
    model = onnx.load(str(d / "f32.onnx"), load_external_data=False)
    windows = [
        next((a.i for a in n.attribute if a.name == "local_window_size"), None)
        for n in model.graph.node
        if n.op_type == "GroupQueryAttention"
    ]
    assert windows == [8, 8, 8, 8, 8, None]
    shape = shape_of(GGUFModel(g))
    sess = DecoderSession(_with_attribute(d, "f32", "local_window_size", None), shape, 1)
    (logits,) = run_chunks(sess, shape, [len(IDS)])
    assert np.abs(logits - references["gemma3"][-1]).max() > 100 * TOL


def test_gemma3_config_when_read_then_family_values_resolved(tiny_families):
    cfg = GGUFModel(tiny_families["gemma3"][0]).config
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.sliding_window) == (32, 1, 8)
    assert cfg.sliding_layers == (0, 1, 2, 3, 4)
    assert [cfg.layer_rope(i).base for i in range(6)] == [10000.0] * 5 + [1e6]
    assert cfg.embed_scale == pytest.approx(math.sqrt(64)) and cfg.attention_scale == pytest.approx(32**-0.5)


def test_head_dim_256_with_one_kv_head_when_converted_then_matches_reference(tmp_path):
    """Gemma 3 270M's attention shape (4 heads x 256 over hidden 640, 1 KV head), tiny otherwise."""
    spec = TinySpec(n_layers=6, n_kv_heads=1, head_dim=256, rope_base=1e6, rms_eps=1e-6, sliding_window=8)
    g = write_tiny_gguf(tmp_path / "m.gguf", family="gemma3", spec=spec, matrix_type="Q4_0", seed=5)
    d = tmp_path / "onnx"
    d.mkdir()
    frag = convert(g, d, variants=["q4"], measure=False)
    assert frag["kv_bytes_per_token"] == 6 * 2 * 1 * 256 * 4
    model = GGUFModel(g)
    shape = shape_of(model)
    ref = ReferenceForward(model).logits(IDS)
    steps = run_chunks(DecoderSession(d / "q4.onnx", shape, 1), shape, [12, *[1] * 8])
    assert np.abs(steps[0] - ref[11]).max() < TOL
    assert np.abs(steps[-1] - ref[-1]).max() < TOL


@pytest.mark.parametrize("family", TINY)
def test_convert_when_family_then_manifest_and_genai_config_name_it(tiny_families, family):
    _, d, frag = tiny_families[family]
    arch = frag["architecture"]
    assert arch["name"] == ("llama" if family == "llama3" else family)
    assert ModelShape.from_architecture(arch).kv_bytes_per_token() == frag["kv_bytes_per_token"]
    genai = json.loads((d / "genai_config.json").read_text())["model"]
    assert genai["type"] == FAMILIES[arch["name"]].genai_type
    assert genai["decoder"]["head_size"] == arch["head_dim"]


# -- the reference against llama.cpp ----------------------------------------------------------------------

# llama.cpp rounds GELU's input and output to fp16 (its lookup table), the only step not in fp32 once its KV
# cache is fp32: gemma3 gets a wider bound, still 100x below what a wrong window or RoPE base costs
LLAMA_CPP_TOL = {"gemma3": 2e-2}


@pytest.mark.parametrize("family", TINY)
def test_reference_when_compared_with_llama_cpp_then_same_logits(tmp_path, family):
    llama_cpp = pytest.importorskip("llama_cpp")
    g = write_tiny_gguf(tmp_path / "m.gguf", family=family, seed=3)  # F32: no quantization on either side
    ref = ReferenceForward(GGUFModel(g)).logits(IDS)
    llm = llama_cpp.Llama(
        str(g), n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=1, type_k=0, type_v=0
    )  # type 0 = GGML_TYPE_F32 keys and values
    llm.eval(IDS)
    theirs = np.array(llm.scores[: len(IDS)])
    assert np.abs(theirs - ref).max() < LLAMA_CPP_TOL.get(family, 1e-3)


# -- unsupported input ------------------------------------------------------------------------------------


def test_convert_when_unknown_architecture_then_unsupported_architecture_listing_families(tmp_path):
    g = write_tiny_gguf(tmp_path / "m.gguf", architecture="mamba")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsupportedArchitecture) as err:
        convert(g, out)
    assert err.value.code == "unsupported_architecture"
    assert "architecture 'mamba'" in str(err.value)
    assert all(name in str(err.value) for name in ("llama", "qwen2", "qwen3", "gemma3"))
    assert not list(out.iterdir())


def test_cli_pull_when_unknown_architecture_then_exit_1_and_nothing_installed(tmp_path, capsys):
    g = write_tiny_gguf(tmp_path / "tiny-mamba.gguf", architecture="mamba")
    settings = Settings(home=tmp_path / "home")
    assert cli.main(["pull", str(g)], settings=settings) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "supported: llama, qwen2, qwen3, gemma3" in err
    assert cli.main(["list"], settings=settings) == 0
    assert "no models installed" in capsys.readouterr().out


def test_reader_when_a_tensor_the_family_would_ignore_then_unsupported(tmp_path):
    """A llama file with Q/K/V biases (a qwen2 layout under the llama name) must not convert silently."""
    g = write_tiny_gguf(tmp_path / "m.gguf", family="qwen2", architecture="llama")
    with pytest.raises(UnsupportedModel, match=r"attn_k\.bias.*not part of the llama family"):
        GGUFModel(g)


# -- onnxruntime-genai --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", TINY)
def test_genai_when_folder_loaded_then_same_greedy_ids_as_our_session(tiny_families, family):
    """Our folders stay runnable by onnxruntime-genai (genai_config.json's `type` per family)."""
    og = pytest.importorskip("onnxruntime_genai")
    g, d, _ = tiny_families[family]
    shape = shape_of(GGUFModel(g))
    sess, kv = DecoderSession(d / "q4.onnx", shape, 1), KVCache(shape, 48)
    cfg = json.loads((d / "genai_config.json").read_text())
    cfg["model"]["decoder"]["filename"] = "q4.onnx"
    (d / "genai_config.json").write_text(json.dumps(cfg))
    logits, ours = sess.run(np.array(IDS[:8]), kv, 0), []
    for pos in range(8, 16):
        ours.append(int(logits.argmax()))
        logits = sess.run(np.array([ours[-1]]), kv, pos)
    model = og.Model(str(d))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=32)
    gen = og.Generator(model, params)
    gen.append_tokens(IDS[:8])
    theirs = []
    for _ in range(8):
        gen.generate_next_token()
        theirs.append(int(gen.get_next_tokens()[0]))
    assert theirs == ours
