"""The GGUF reader: FastGGUFReader parses exactly what gguf.GGUFReader parses."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from models.gguf.reader import FastGGUFReader
from tests.tiny_gguf import write_tiny_gguf


def test_fast_reader_when_parsing_then_identical_fields_and_tensors(tmp_path):
    g = write_tiny_gguf(tmp_path / "m.gguf", family="qwen2", matrix_type="Q8_0")
    ours, stock = FastGGUFReader(g), GGUFReader(g)
    assert list(ours.fields) == list(stock.fields)
    for key, a in ours.fields.items():
        b = stock.fields[key]
        assert (a.offset, a.types, a.data, len(a.parts)) == (b.offset, b.types, b.data, len(b.parts)), key
        assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a.parts, b.parts, strict=True))
        assert a.contents() == b.contents(), key
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) > 256  # string arrays took the fast path
    for a, b in zip(ours.tensors, stock.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == (
            b.name,
            b.tensor_type,
            list(b.shape),
            b.data_offset,
        )
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
