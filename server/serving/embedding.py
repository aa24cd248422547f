"""Embeddings on the worker thread: an `EmbedJob` is a request's inputs for one embedding model, run a
bounded batch (models/runtime/embedder.py's MAX_BATCH rows) per turn of the worker, which puts the job
back at the end of its embedding queue between batches and alternates it with generation jobs, so a large
request never holds the worker for more than one batch while others wait.

The inputs are tokenized (strings) and checked (every row: ids in the vocabulary, within the context) on
the worker before the first pass, so a request is answered whole or refused whole. The worker keeps one
embedding model open (`EncoderShelf`), beside the model pool; it is not in the pool's memory plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models.runtime.embedder import MAX_BATCH, Embedder
from models.types import CancelToken
from server.serving.contracts import Gate, Sink
from server.serving.events import Failed

# Inputs per request. Each is checked and tokenized before the first pass, and every vector is held until
# the last batch: 256 inputs of 384 floats is 400 KB; at 32 rows a pass, 8 turns of the worker.
MAX_EMBED_INPUTS = 256


@dataclass(frozen=True)
class Embedded:
    """The job's answer: one vector per input, in order, and the tokens they held."""

    vectors: np.ndarray  # [inputs, dimensions] float32
    prompt_tokens: int


class EncoderShelf:
    """The embedding model the worker has open: opened on first use, replaced when another is asked for.
    Worker thread only."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads
        self._open: tuple[str, Path, Embedder] | None = None

    def get(self, model_id: str, path: Path) -> Embedder:
        if self._open is None or self._open[:2] != (model_id, path):
            self._open = None  # the old session goes before the new one loads
            self._open = (model_id, path, Embedder(path, threads=self.threads))
        return self._open[2]


@dataclass
class EmbedJob:
    id: str
    model_id: str
    path: Path  # the model's installed folder
    inputs: list[str] | list[list[int]]
    sink: Sink
    param: str = "input"  # the request's name for the inputs, which a refusal names
    fit: bool = False  # texts over the context cut to fit (Ollama's truncate) rather than refused
    cancel: CancelToken = field(default_factory=CancelToken)
    enqueued_at: float = field(default_factory=time.monotonic)
    rows: list[list[int]] | None = None  # tokenized and checked, on the worker
    parts: list[np.ndarray] = field(default_factory=list)
    batches_run: int = 0  # gated_step counts them
    pass_s: float | None = None  # the last batch's forward pass, for the governor's CPU budget

    @property
    def done_rows(self) -> int:
        return sum(len(p) for p in self.parts)

    def step(self, shelf: EncoderShelf) -> bool:
        """One batch on the worker thread. True when the job is over: answered, failed or its client gone."""
        if self.cancel.cancelled:
            return True
        try:
            encoder = shelf.get(self.model_id, self.path)
            if self.rows is None:
                texts = [x for x in self.inputs if isinstance(x, str)]
                rows = (
                    encoder.tokenize(texts, fit=self.fit)
                    if texts
                    else [list(x) for x in self.inputs if not isinstance(x, str)]
                )
                encoder.check(rows, param=self.param)
                self.rows = rows
            start = self.done_rows
            began = time.monotonic()
            self.parts.append(encoder.embed(self.rows[start : start + MAX_BATCH]))
            self.pass_s = time.monotonic() - began
        except Exception as err:  # a refusal (SimmerError) or the engine's own failure: the job's answer
            self.sink(Failed(err))
            return True
        if self.done_rows < len(self.rows):
            return False
        self.sink(Embedded(np.concatenate(self.parts), sum(len(r) for r in self.rows)))
        return True


def gated_step(job: EmbedJob, shelf: EncoderShelf, gate: Gate) -> bool:
    """The job's next batch behind the governor's gate (Gate.before_batch): paused while the governor
    pauses (new work before the first batch, running work after), idled after a pass for the CPU budget,
    failed when the pause outlasts its timeout or the device stopped the app. True when the job is over."""
    try:
        gate.before_batch(job.cancel, job.enqueued_at, job.pass_s if job.batches_run else None)
    except Exception as err:  # device_paused, device_overheated, cancelled: the job's answer
        job.sink(Failed(err))
        return True
    job.batches_run += 1
    return job.step(shelf)
