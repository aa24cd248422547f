"""studies/experiments/kv_int8.py's two int8 caches on the tiny model: what they store is what the bench says
they store, and the logits stay near the fp32 cache's."""

from __future__ import annotations

import json

import numpy as np

from models.runtime.session import DecoderSession, ModelShape
from studies.experiments.kv_int8 import (
    BlockQSession,
    TypedKV,
    blockq_graph,
    calibrate,
    quantized_graph,
    scales_for,
)

IDS = [1, 17, 42, 99, 5, 63, 120, 7, 33, 88, 2, 71]


def _open(model_dir):
    manifest = json.loads((model_dir / "manifest.json").read_text())
    shape = ModelShape.from_architecture(manifest["architecture"])
    return model_dir / manifest["variants"]["f32"]["file"], shape


def _decode(sess, kv) -> np.ndarray:
    return np.stack([sess.run(np.array([t]), kv, pos).copy() for pos, t in enumerate(IDS)])


def test_gqa_int8_when_per_channel_scales_then_cache_is_round_of_fp32_over_scale_and_logits_close(
    tiny_model_dir, tmp_path
):
    src, shape = _open(tiny_model_dir)
    base = DecoderSession(src, shape, 1)
    ref_kv = TypedKV(shape, len(IDS), np.float32)
    ref = _decode(base, ref_kv)
    scales = scales_for(calibrate(base, shape, [IDS]), "PER_CHANNEL", 1.0)
    quant = DecoderSession(quantized_graph(src, tmp_path, "int8", scales, "PER_CHANNEL"), shape, 1)
    kv = TypedKV(shape, len(IDS), np.int8)
    got = _decode(quant, kv)

    # layer 0's keys depend on the tokens only, so the fp32 run's are the exact reference
    (k32, _), (k8, _) = ref_kv.arrays[0], kv.arrays[0]
    ks = scales[0][0][None, :, None, :]  # [kv_heads, head_dim], the same for every position
    assert k8.dtype == np.int8 and np.array_equal(k8, np.clip(np.round(k32 / ks), -128, 127))
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert not np.array_equal(got, ref)  # the int8 cache is really read


def test_block_graph_when_decoding_then_each_block_within_half_a_step_and_logits_close(
    tiny_model_dir, tmp_path
):
    src, shape = _open(tiny_model_dir)
    base = DecoderSession(src, shape, 1)
    ref_kv = TypedKV(shape, len(IDS), np.float32)
    ref = _decode(base, ref_kv)
    block = shape.head_dim // 2
    sess = BlockQSession(blockq_graph(src, tmp_path, "block", shape, block), shape, 1, block)
    kv = sess.new_cache(len(IDS))
    got = _decode(sess, kv)

    q, s = kv["q.0.value"], kv["s.0.value"]  # layer 0's values depend on the tokens only: exact reference
    deq = (q.reshape(*q.shape[:3], -1, block).astype(np.float32) * s[..., None]).reshape(q.shape)
    v32 = ref_kv.arrays[0][1]
    step = np.repeat(s, block, axis=-1)
    assert np.all(np.abs(deq - v32) <= step / 2 + 1e-6)
    assert np.allclose(s, np.abs(v32).reshape(*q.shape[:3], -1, block).max(-1) / 127, rtol=1e-5)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
