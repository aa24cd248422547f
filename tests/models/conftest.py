"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.convert.encoder_convert import convert_encoder
from models.runtime.embedder import Embedder
from models.runtime.engine import DecoderEngine
from tests.helpers import tiny_engine
from tests.reference_bert import write_tiny_bert


@pytest.fixture
def tiny_decoder(request, tiny_model_dir) -> DecoderEngine:
    """The tiny real model; a module sets TINY_CONTEXT for another context length than 256."""
    return tiny_engine(tiny_model_dir, context_length=getattr(request.module, "TINY_CONTEXT", 256))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict, Embedder]:
    """(a tiny sentence-transformers folder, its config.json, the Embedder of its converted folder)."""
    src = tmp_path_factory.mktemp("tiny-bert")
    cfg = write_tiny_bert(src, context=16)
    out = tmp_path_factory.mktemp("tiny-encoder")
    convert_encoder(src, out)
    return src, cfg, Embedder(out)
