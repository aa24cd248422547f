"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from models.runtime.engine import DecoderEngine
from tests.helpers import tiny_engine


@pytest.fixture
def tiny_decoder(request, tiny_model_dir) -> DecoderEngine:
    """The tiny real model; a module sets TINY_CONTEXT for another context length than 256."""
    return tiny_engine(tiny_model_dir, context_length=getattr(request.module, "TINY_CONTEXT", 256))
