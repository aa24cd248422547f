"""Our converted folders keep loading in onnxruntime-genai (0.18): its greedy ids and logits equal ours.

onnxruntime-genai reads the folder's genai_config.json and runs the decoder it names with its own KV
management, so this checks our I/O convention and config, not just our graph.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime_genai as og  # a dev dependency: a missing one must fail, not skip
import pytest

from tests.models.runtime.helpers import og_greedy, ours_greedy

PROMPTS = ([1, 5, 17, 40, 33, 9], [7, 100, 200, 31, 5, 250, 11], [2, 3])


def test_genai_when_our_tiny_folder_then_same_greedy_ids_and_logits(tiny_model_dir) -> None:
    from models.runtime.session import DecoderSession, KVCache, ModelShape

    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    arch = manifest["architecture"]
    shape = ModelShape(arch["n_layers"], arch["n_kv_heads"], arch["head_dim"], arch["vocab"])
    decoder = json.loads((tiny_model_dir / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    model = og.Model(str(tiny_model_dir))
    for prompt in PROMPTS:
        ids, og_logits = og_greedy(model, list(prompt), 10)
        assert ids == ours_greedy(tiny_model_dir, prompt, 10, context_length=64), prompt
        # and the logits each token was chosen from
        sess, kv = DecoderSession(tiny_model_dir / decoder, shape, 1), KVCache(shape, 64)
        fed = list(prompt)
        logits = sess.run(np.array(fed), kv, 0).copy()
        for step, token in enumerate(ids):
            np.testing.assert_allclose(og_logits[step], logits, atol=1e-4)
            logits = sess.run(np.array([token]), kv, len(fed)).copy()
            fed.append(token)


def test_genai_when_foreign_separate_buffer_folder_then_same_greedy_ids(tiny_model_dir, tmp_path) -> None:
    """The re-exported folders our general path serves are real onnxruntime-genai folders too."""
    from tests.models import genai_folders as gf

    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "separate", share_buffer=False)
    gf.all_position_logits(folder)
    model = og.Model(str(folder))
    for prompt in PROMPTS:
        assert og_greedy(model, list(prompt), 8)[0] == ours_greedy(
            tiny_model_dir, prompt, 8, context_length=64
        )


@pytest.mark.slow
def test_genai_when_smollm2_folder_then_same_greedy_ids(smollm2_model_dir) -> None:
    # llama.cpp's ids for the chat-templated "What is the capital of France?" (no BOS)
    prompt = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    ids, _ = og_greedy(og.Model(str(smollm2_model_dir)), prompt, 8)
    assert ids == ours_greedy(smollm2_model_dir, prompt, 8, context_length=256)
