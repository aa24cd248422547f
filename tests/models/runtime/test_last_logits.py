"""Logits for the last k positions (the graph's num_logits_to_keep input): a speculative verification pass
gets one row per fed position, equal to what feeding those tokens one at a time gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.runtime.session import DecoderSession, KVCache, ModelShape

PROMPT = [5, 40, 17, 33, 9, 120, 7, 64, 3]


def open_session(model_dir: Path, variant: str) -> tuple[DecoderSession, ModelShape]:
    manifest = json.loads((model_dir / "manifest.json").read_text())
    shape = ModelShape.from_architecture(manifest["architecture"])
    return DecoderSession(model_dir / manifest["variants"][variant]["file"], shape, 1), shape


def one_at_a_time(sess: DecoderSession, shape: ModelShape, ids: list[int], capacity: int) -> np.ndarray:
    kv = KVCache(shape, capacity)
    return np.stack([sess.run(np.array([t]), kv, i).copy() for i, t in enumerate(ids)])


@pytest.mark.parametrize("variant", ["f32", "q4", "q4-a8"])
def test_last_k_when_whole_prompt_then_equal_to_feeding_one_at_a_time(tiny_model_dir, variant) -> None:
    sess, shape = open_session(tiny_model_dir, variant)
    assert sess.multi_logits
    expected = one_at_a_time(sess, shape, PROMPT, 64)
    got = sess.run_last(np.array(PROMPT), KVCache(shape, 64), 0, len(PROMPT)).copy()
    assert got.shape == (len(PROMPT), shape.vocab)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_last_k_when_after_a_past_then_rows_are_the_fed_positions(tiny_model_dir) -> None:
    """The verification pass: a past in the KV buffer, then k new tokens, k rows of logits."""
    sess, shape = open_session(tiny_model_dir, "q4")
    expected = one_at_a_time(sess, shape, PROMPT, 64)
    kv = KVCache(shape, 64)
    sess.run(np.array(PROMPT[:5]), kv, 0)
    got = sess.run_last(np.array(PROMPT[5:]), kv, 5, 4).copy()
    np.testing.assert_allclose(got, expected[5:], atol=1e-4, rtol=0)
    # fewer rows than fed positions: the last ones
    kv2 = KVCache(shape, 64)
    sess.run(np.array(PROMPT[:5]), kv2, 0)
    np.testing.assert_allclose(sess.run_last(np.array(PROMPT[5:]), kv2, 5, 2), expected[-2:], atol=1e-4)
    # and back to one row (the binding follows k)
    np.testing.assert_allclose(sess.run(np.array(PROMPT[-1:]), kv2, 8), expected[-1], atol=1e-4)


def test_last_k_when_more_than_fed_then_refused(tiny_model_dir) -> None:
    sess, shape = open_session(tiny_model_dir, "q4")
    with pytest.raises(ValueError, match="last 4 of 3"):
        sess.run_last(np.array(PROMPT[:3]), KVCache(shape, 16), 0, 4)


def test_graph_when_no_logits_count_fed_then_every_position(tiny_model_dir) -> None:
    """The input's default (0) is onnxruntime-genai's convention: logits over the whole sequence."""
    import onnxruntime as ort

    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    shape = ModelShape.from_architecture(manifest["architecture"])
    sess = ort.InferenceSession(str(tiny_model_dir / manifest["variants"]["f32"]["file"]))
    empty = np.zeros((1, shape.n_kv_heads, 0, shape.head_dim), np.float32)
    feeds = {"input_ids": np.array([PROMPT]), "attention_mask": np.ones((1, len(PROMPT)), np.int64)}
    feeds |= {i.name: empty for i in sess.get_inputs() if i.name.startswith("past_key_values.")}
    (logits,) = sess.run(["logits"], feeds)
    assert logits.shape == (1, len(PROMPT), shape.vocab)
    (last2,) = sess.run(["logits"], feeds | {"num_logits_to_keep": np.array(2, np.int64)})
    np.testing.assert_allclose(last2[0], logits[0, -2:], atol=1e-5)


@pytest.mark.slow
def test_last_k_when_smollm2_q4_then_equal_to_feeding_one_at_a_time(smollm2_model_dir) -> None:
    """q4 (fp32 activations): a row does not depend on how many rows the pass has, up to summation order.
    q4-a8 is not row-exact on onnxruntime 1.32's x86 kernels (its M=1 and M>1 paths quantize activations
    differently, ~1 logit apart): speculation checks that per session (DecoderEngine._speculation)."""
    sess, shape = open_session(smollm2_model_dir, "q4")
    ids = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]
    expected = one_at_a_time(sess, shape, ids, 32)
    kv = KVCache(shape, 32)
    sess.run(np.array(ids[:4]), kv, 0)
    got = sess.run_last(np.array(ids[4:]), kv, 4, len(ids) - 4)
    np.testing.assert_allclose(got, expected[4:], atol=1e-3, rtol=0)
    assert (got.argmax(-1) == expected[4:].argmax(-1)).all()
