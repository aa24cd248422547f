"""Our tokenizer files load in onnxruntime-genai (next to a converted model, as it reads them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from models.convert.tokenizer_gguf import tokenizer_from_metadata
from tests.tiny_vocab import FAMILIES, family_metadata

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")

# onnxruntime-genai's regex engine cannot compile Tekken's lookahead pattern.
LOADABLE = sorted(set(FAMILIES) - {"tekken"})
PLAIN = ["hello world", "The capital of France is", "line one\nline two", "x = [1, 2]"]


def genai_tokenizer(tiny_model_dir: Path, tmp_path: Path, family: str):
    folder = tmp_path / family
    shutil.copytree(tiny_model_dir, folder)
    tok = tokenizer_from_metadata(family_metadata(FAMILIES[family]))
    tok.save(folder)  # replaces the tiny model's tokenizer.json and tokenizer_config.json
    return tok, og.Tokenizer(og.Model(str(folder)))


@pytest.mark.parametrize("family", LOADABLE)
def test_genai_when_tokenizer_saved_then_it_loads(tiny_model_dir, tmp_path, family: str) -> None:
    _, genai = genai_tokenizer(tiny_model_dir, tmp_path, family)
    assert len(genai.encode("hello")) > 0


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt2"])
def test_genai_when_byte_level_then_same_ids_on_plain_text(tiny_model_dir, tmp_path, family: str) -> None:
    tok, genai = genai_tokenizer(tiny_model_dir, tmp_path, family)
    for text in PLAIN:
        # onnxruntime-genai's encode never adds BOS; compare the text's own ids
        assert [int(i) for i in genai.encode(text)] == tok.encode(text, add_special_tokens=False)
