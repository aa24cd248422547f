"""bench/embed_sides.py's simmer side: a batch-32 run over its sentence list is timed as the server runs one
request of the list (batches ordered by length over all of it); a batch-1 run as a request per text."""

from __future__ import annotations

import numpy as np
import pytest

from bench.embed_sides import SimmerSide
from models.convert.encoder_convert import convert_encoder
from models.runtime.embedder import MAX_BATCH, Embedder
from tests.reference_bert import write_tiny_bert


@pytest.fixture(scope="module")
def side(tmp_path_factory) -> SimmerSide:
    src = tmp_path_factory.mktemp("tiny-bert")
    write_tiny_bert(src, context=16)
    out = tmp_path_factory.mktemp("tiny-encoder")
    convert_encoder(src, out)
    return SimmerSide(out, threads=1)


def texts(n: int) -> list[str]:
    words = ["the", "cat", "sat", "on", "mat", "dog"]
    return [" ".join(words[(i + k) % len(words)] for k in range(1 + (i * 5) % 13)) for i in range(n)]


def test_simmer_side_when_a_batch_run_then_one_length_ordered_request_and_batch_1_a_request_each(
    side, monkeypatch
):
    sentences = texts(2 * MAX_BATCH + 7)
    alone = np.concatenate([side.embed([t]) for t in sentences])
    passes: list[list[int]] = []
    embed = Embedder.embed

    def recording(self, rows):
        passes.append([len(r) for r in rows])
        return embed(self, rows)

    monkeypatch.setattr(Embedder, "embed", recording)
    got = side.run(sentences, MAX_BATCH)
    assert np.abs(got - alone).max() < 1e-5
    lengths = [n for p in passes for n in p]
    assert len(passes) == 3 and lengths == sorted(lengths)  # batches cut from the length order
    passes.clear()
    one = side.run(sentences[:3], 1)
    assert [len(p) for p in passes] == [1, 1, 1]  # batch 1: a request each
    assert np.abs(one - alone[:3]).max() < 1e-5
