"""Qwen2.5-Coder 0.5B Instruct, end to end: pulled from its GGUF through the store (converted, measured, smoke
tested, verified), then greedy chat replies against llama.cpp's on the same GGUF
(tests/fixtures/qwen2.5_coder_0.5b_llamacpp.json, written by tests/fixtures/make_llamacpp_fixtures.py qwen).

Compared only where the choice is clear: llama.cpp quantizes activations its own way (its logits differ from
the fp32 reference by up to ~1.5 on these models), so a step whose margin (best logit minus the second, ours
or llama.cpp's, recorded in the fixture) is under WIDE may go either way on another CPU. Every step is
teacher-forced with llama.cpp's token, so one close call does not end the comparison; where every step of
a reply is clear, the whole free-running greedy text must be llama.cpp's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.runtime.session import DecoderSession, KVCache, ModelShape
from models.runtime.tokenizer import Tokenizer
from models.store.store import ModelStore, default_converter

FIXTURE = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "qwen2.5_coder_0.5b_llamacpp.json").read_text(encoding="utf-8")
)
WIDE = 2.0  # logits: far beyond the two engines' differences at one step
MIN_COMPARED = 6  # a test that compared nothing would prove nothing


@pytest.fixture(scope="module")
def installed(qwen_coder_05b_gguf: Path, tmp_path_factory) -> Path:
    store = ModelStore(tmp_path_factory.mktemp("home"), converter=default_converter())
    model = store.pull(str(qwen_coder_05b_gguf), variants=["q4-a8"])  # the variant compared below
    assert model.id == "qwen2.5-coder-0.5b" and "q4-a8" in model.variants
    assert model.manifest["variants"]["q4-a8"]["quality"]["top1_agreement"] >= 0.9
    return model.path


@pytest.mark.slow
@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["question"] for c in FIXTURE["cases"]])
def test_qwen_coder_05b_when_pulled_then_greedy_text_is_llama_cpps_where_the_margin_is_wide(
    installed: Path, case: dict
) -> None:
    manifest = json.loads((installed / "manifest.json").read_text())
    tokenizer = Tokenizer.load(installed)
    assert tokenizer.encode(case["prompt"], add_special_tokens=False) == case["prompt_ids"]
    shape = ModelShape.from_architecture(manifest["architecture"])
    sess = DecoderSession(installed / manifest["variants"]["q4-a8"]["file"], shape, 2)
    ids, theirs = case["prompt_ids"], case["greedy_ids"]
    kv = KVCache(shape, len(ids) + len(theirs))
    logits = sess.run(np.array(ids), kv, 0)
    ours, clear = [], 0
    for i, (token, margin) in enumerate(zip(theirs, case["margins"], strict=True)):
        top2 = np.sort(np.partition(logits, -2)[-2:])
        ours.append(int(logits.argmax()))
        if margin >= WIDE and top2[1] - top2[0] >= WIDE:
            assert ours[-1] == token, f"token {i}: ours {ours[-1]}, llama.cpp {token}, both margins >= {WIDE}"
            clear += 1
        logits = sess.run(np.array([token]), kv, len(ids) + i)  # teacher-forced: llama.cpp's token
    assert clear >= MIN_COMPARED, f"only {clear} steps had a wide margin"
    if clear == len(theirs):  # every step clear: the free-running replies are the same text
        assert tokenizer.decode(ours) == tokenizer.decode(theirs) == case["greedy_text"]
