"""An fp16 KV cache (convert(kv_dtype="float16")): the graph declares it, the engine allocates what the
graph declares (never what a manifest or a default says), and its logits stay the fp32 cache's within the
rounding of an fp16 key and value."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from models.convert.pipeline import convert, smoke_test
from models.runtime.session import DecoderSession, KVCache
from tests.helpers import tiny_engine

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 64, 128, 9, 31]
DECODE = 8


@pytest.fixture(scope="module")
def fp16_model_dir(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny GGUF converted as on a core with fp16 arithmetic, measured as a pull measures (the
    segments too take an fp16 cache)."""
    out = tmp_path_factory.mktemp("tiny-kv16") / "tiny-kv16"
    out.mkdir()
    fragment = convert(tiny_gguf, out, variants=["q4", "q4-a8"], threads=1, kv_dtype="float16")
    (out / "manifest.json").write_text(json.dumps(fragment | {"id": out.name}))
    return out


def kv_types(onnx_file: Path) -> set[int]:
    graph = onnx.load(onnx_file, load_external_data=False).graph
    return {
        v.type.tensor_type.elem_type
        for v in [*graph.input, *graph.output]
        if v.name.startswith(("past_key_values.", "present."))
    }


def test_convert_when_fp16_then_int8_variants_half_and_the_exact_one_fp32(fp16_model_dir) -> None:
    variants = json.loads((fp16_model_dir / "manifest.json").read_text())["variants"]
    assert variants["q4-a8"]["kv_dtype"] == "float16"
    assert variants["q4"]["kv_dtype"] == "float32"  # exact: the reference's to the rounding
    assert kv_types(fp16_model_dir / "q4-a8.onnx") == {TensorProto.FLOAT16}
    assert kv_types(fp16_model_dir / "q4.onnx") == {TensorProto.FLOAT}
    # the attention runs in fp16: its packed QKV input is cast to it
    graph = onnx.load(fp16_model_dir / "q4-a8.onnx", load_external_data=False).graph
    casts = {n.output[0]: n for n in graph.node if n.op_type == "Cast"}
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(casts[n.input[0]].attribute[0].i == TensorProto.FLOAT16 for n in gqa)


def test_convert_when_unknown_kv_dtype_then_refused(tiny_gguf, tmp_path) -> None:
    with pytest.raises(Exception, match="unknown KV type 'int8'"):
        convert(tiny_gguf, tmp_path, variants=["q4-a8"], measure=False, threads=1, kv_dtype="int8")


def greedy_logits(model_dir: Path, variant: str) -> tuple[np.ndarray, KVCache]:
    """A prefill of PROMPT, then DECODE greedy steps of one token: every step's logits."""
    engine = tiny_engine(model_dir, variant=variant)
    sess = engine.session()
    assert isinstance(sess, DecoderSession)
    kv = engine.new_cache(64)
    rows = [sess.run(np.array(PROMPT), kv, 0).copy()]
    for pos in range(len(PROMPT), len(PROMPT) + DECODE):
        rows.append(sess.run(np.array([int(rows[-1].argmax())]), kv, pos).copy())
    return np.stack(rows), kv


def test_fp16_cache_when_decoding_then_the_fp32_cache_logits_within_fp16_rounding(
    tiny_model_dir, fp16_model_dir
) -> None:
    want, kv32 = greedy_logits(tiny_model_dir, "q4-a8")
    got, kv16 = greedy_logits(fp16_model_dir, "q4-a8")
    assert kv32.arrays[0][0].dtype == np.float32 and kv16.arrays[0][0].dtype == np.float16
    # the same tokens were fed (greedy on both). The first layer's values are the fp32 cache's rounded to
    # fp16; its keys are within the rounding of RoPE computed in fp16 (the attention runs in fp16)
    n = len(PROMPT) + DECODE
    (k32, v32), (k16, v16) = (a[:, :, :n] for a in kv32.arrays[0]), (a[:, :, :n] for a in kv16.arrays[0])
    assert np.array_equal(v32.astype(np.float16), v16)
    assert np.abs(k16.astype(np.float32) - k32).max() <= 2e-3 * np.abs(k32).max()
    assert (want.argmax(-1) == got.argmax(-1)).all()
    err = np.abs(got - want).max()
    assert 0 < err < 2e-2 * np.abs(want).max(), err  # not the same graph, and not far from it


def test_engine_when_graph_is_fp16_then_caches_follow_the_graph_not_the_manifest(
    fp16_model_dir, tmp_path
) -> None:
    # a copy whose manifest says nothing of the KV type: the session's input decides
    folder = tmp_path / "silent"
    shutil.copytree(fp16_model_dir, folder, copy_function=os.link)
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["variants"].values():
        entry.pop("kv_dtype")
    (folder / "manifest.json").unlink()  # a hard link: write a new file, not the shared one
    (folder / "manifest.json").write_text(json.dumps(manifest))
    engine = tiny_engine(folder, variant="q4-a8")
    shape = engine.session().shape
    assert shape.kv_dtype == "float16"
    cache = engine.new_cache(32)
    assert {a.dtype for pair in cache.arrays for a in pair} == {np.dtype(np.float16)}
    assert cache.nbytes == 32 * shape.kv_bytes_per_token()
    assert (
        shape.kv_bytes_per_token() * 2
        == tiny_engine(folder, variant="q4").session().shape.kv_bytes_per_token()
    )


def test_batch_when_graph_is_fp16_then_its_rows_are_fp16_and_decode(fp16_model_dir) -> None:
    engine = tiny_engine(fp16_model_dir, variant="q4-a8")
    decoder = engine.batch_decoder(2)
    if decoder is None:
        pytest.skip("this CPU's probe refuses a batch for the tiny q4-a8 (batch_traits)")
    assert {a.dtype for pair in decoder.kv.arrays for a in pair} == {np.dtype(np.float16)}


def test_smoke_test_when_the_nominal_variant_has_a_half_cache_then_it_runs(fp16_model_dir) -> None:
    manifest = json.loads((fp16_model_dir / "manifest.json").read_text())
    smoke_test(fp16_model_dir, manifest | {"default_variant": "q4-a8"})  # raises VerificationFailed if not


def test_convert_when_fp16_then_quality_measured_with_the_half_cache(fp16_model_dir, tiny_model_dir) -> None:
    half = json.loads((fp16_model_dir / "manifest.json").read_text())["variants"]["q4-a8"]["quality"]
    full = json.loads((tiny_model_dir / "manifest.json").read_text())["variants"]["q4-a8"]["quality"]
    assert half["kl_mean"] != full["kl_mean"]  # the same graph but its cache: measured through it
    assert half["top1_agreement"] >= full["top1_agreement"] - 0.05


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_fp16_cache_when_qk_norm_and_windows_then_within_fp16_of_fp32(family, tmp_path) -> None:
    """Families whose attention takes q, k and v apart (QK norm) and, for Gemma 3, local windows with
    their own RoPE cache: the fp16 attention casts each input, and every RoPE cache has its fp16 copy."""
    from tests.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "m.gguf", family=family, matrix_type="Q8_0", seed=3)
    logits = {}
    for kv in ("float32", "float16"):
        out = tmp_path / kv
        out.mkdir()
        fragment = convert(gguf, out, variants=["q4-a8"], measure=False, threads=1, kv_dtype=kv)
        (out / "manifest.json").write_text(json.dumps(fragment | {"id": family}))
        logits[kv], _ = greedy_logits(out, "q4-a8")
    want, got = logits["float32"], logits["float16"]
    assert (want.argmax(-1) == got.argmax(-1)).all()
    assert 0 < np.abs(got - want).max() < 2e-2 * np.abs(want).max()
