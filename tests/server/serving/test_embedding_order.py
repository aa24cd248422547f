"""An embedding job's batches are cut from its rows ordered by length (server/serving/embedding.py's
by_length), so each batch pads little, and every vector comes back at its input's index: a recording
encoder sees the batches, the real all-MiniLM-L6-v2 gives the vectors."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from models.convert.encoder_convert import convert_encoder
from models.errors import ContextLengthExceeded
from models.runtime.embedder import MAX_BATCH, Embedder
from server.serving.contracts import NoGate
from server.serving.embedding import TOKENIZE_CHUNK, Embedded, EmbedJob, EncoderShelf, by_length, gated_step
from server.serving.events import Failed
from tests.reference_bert import minilm_folder

SENTENCE = "the cat sat on a mat while seven quiet engineers measured how warm the small phone became"


def mixed_texts(n: int) -> list[str]:
    """n sentences of 1 to 23 words, their lengths scattered so request order pads a lot."""
    words = SENTENCE.split()
    return [" ".join(words[(i + k) % len(words)] for k in range(1 + (i * 7) % 23)) for i in range(n)]


def padded_tokens(batches: Sequence[Sequence[Sequence[int]]]) -> int:
    """The tokens the encoder runs: each batch padded to its longest row."""
    return sum(len(b) * max(map(len, b)) for b in batches)


class RecordingShelf(EncoderShelf):
    """A shelf whose encoder is `inner`, noting each batch the job gives it."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.batches: list[list[list[int]]] = []

    def get(self, model_id: str, path: Path):
        return self

    def tokenize(self, texts: Sequence[str], fit: bool = False) -> list[list[int]]:
        return self.inner.tokenize(texts, fit=fit)

    def check(self, rows: Sequence[Sequence[int]], param: str = "input", first: int = 0) -> None:
        self.inner.check(rows, param=param, first=first)

    def embed(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        self.batches.append([list(r) for r in rows])
        return self.inner.embed(rows)


class WordEncoder:
    """A text's row is its character count, then one token per word; its vector names the row:
    [first id, length]."""

    context = 64

    def tokenize(self, texts: Sequence[str], fit: bool = False) -> list[list[int]]:
        return [[len(t)] + [7] * len(t.split()) for t in texts]

    def check(self, rows: Sequence[Sequence[int]], param: str = "input", first: int = 0) -> None:
        for i, row in enumerate(rows, start=first):
            if len(row) > self.context:
                raise ContextLengthExceeded(f"input {i} is too long", param=param)

    def embed(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        assert len(rows) <= MAX_BATCH
        return np.array([[r[0], len(r)] for r in rows], np.float32)


def run(job: EmbedJob, shelf: EncoderShelf) -> list[object]:
    got: list[object] = []
    job.sink = got.append
    while not gated_step(job, shelf, NoGate()):
        pass
    return got


def job_of(inputs: list[str] | list[list[int]], **kw) -> EmbedJob:
    return EmbedJob(id="e", model_id="m", path=Path("unused"), inputs=inputs, sink=lambda _: None, **kw)


def test_embed_job_when_mixed_lengths_then_batches_by_length_and_vectors_in_request_order():
    texts = mixed_texts(100)
    shelf = RecordingShelf(WordEncoder())
    (answer,) = run(job := job_of(texts), shelf)
    assert isinstance(answer, Embedded)
    rows = WordEncoder().tokenize(texts)
    assert answer.vectors.tolist() == [[r[0], len(r)] for r in rows]  # each at its input's index
    assert answer.prompt_tokens == sum(map(len, rows))
    # one step tokenizes (100 texts are one chunk), then four batches
    assert [len(b) for b in shelf.batches] == [32, 32, 32, 4] and job.batches_run == 5
    lengths = [len(r) for b in shelf.batches for r in b]
    assert lengths == sorted(lengths)  # each batch's rows as long as the next batch's shortest, or shorter
    in_request_order = [rows[i : i + MAX_BATCH] for i in range(0, len(rows), MAX_BATCH)]
    assert padded_tokens(shelf.batches) < 0.7 * padded_tokens(in_request_order)


def test_by_length_when_equal_lengths_then_request_order_kept():
    rows = [[1, 2, 3], [1], [4, 5, 6], [2], [1, 2]]
    assert by_length(rows) == [1, 3, 4, 0, 2]


def test_embed_job_when_an_input_is_over_the_context_then_refused_by_its_request_index():
    texts = [*mixed_texts(5), " ".join(["cat"] * 80), "a cat"]
    (answer,) = run(job_of(texts), RecordingShelf(WordEncoder()))
    assert isinstance(answer, Failed) and "input 5 " in str(answer.error)


def test_embed_job_when_the_input_over_the_context_is_in_a_later_chunk_then_refused_by_its_request_index():
    late = TOKENIZE_CHUNK + 88
    texts = [*mixed_texts(late), " ".join(["cat"] * 80), *mixed_texts(20)]
    shelf = RecordingShelf(WordEncoder())
    (answer,) = run(job_of(texts), shelf)
    assert isinstance(answer, Failed) and f"input {late} " in str(answer.error)
    assert not shelf.batches  # refused whole: no pass ran before every input was checked


def test_embed_job_when_cancelled_between_batches_then_no_further_batch():
    shelf = RecordingShelf(WordEncoder())
    job = job_of(mixed_texts(70))
    got: list[object] = []
    job.sink = got.append
    assert gated_step(job, shelf, NoGate()) is False  # tokenized
    assert gated_step(job, shelf, NoGate()) is False  # the first batch
    job.cancel.cancel()
    assert job.step(shelf) is True
    assert len(shelf.batches) == 1 and not got


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Embedder:
    folder = tmp_path_factory.mktemp("minilm")
    convert_encoder(minilm_folder(), folder)
    return Embedder(folder, threads=1)


@pytest.mark.slow
@pytest.mark.parametrize("as_ids", [False, True])
def test_embed_job_when_all_minilm_and_mixed_lengths_then_each_vector_as_its_input_alone(minilm, as_ids):
    texts = mixed_texts(MAX_BATCH * 2 + 7)
    rows = minilm.tokenize(texts)
    alone = np.concatenate([minilm.embed([r]) for r in rows])
    shelf = RecordingShelf(minilm)
    (answer,) = run(job_of(rows if as_ids else texts), shelf)
    assert isinstance(answer, Embedded) and answer.vectors.shape == (len(texts), 384)
    assert np.abs(answer.vectors - alone).max() < 1e-5
    cos = (
        (answer.vectors * alone).sum(1)
        / np.linalg.norm(answer.vectors, axis=1)
        / np.linalg.norm(alone, axis=1)
    )
    assert cos.min() > 0.99999
    lengths = [len(r) for b in shelf.batches for r in b]
    assert lengths == sorted(lengths)
    in_request_order = [rows[i : i + MAX_BATCH] for i in range(0, len(rows), MAX_BATCH)]
    assert padded_tokens(shelf.batches) < padded_tokens(in_request_order)
