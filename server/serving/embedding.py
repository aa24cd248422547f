"""Embeddings on the worker thread: an `EmbedJob` is a request's inputs for one embedding model, run a
bounded batch (models/runtime/embedder.py's MAX_BATCH rows) per turn of the worker, which puts the job
back at the end of its embedding queue between batches and alternates it with generation jobs, so a large
request never holds the worker for more than one batch while others wait.

The inputs are tokenized (strings) and checked (every row: ids in the vocabulary, within the context) on
the worker before the first pass, so a request is answered whole or refused whole. The batches are then cut
from the rows ordered by length (`by_length`), as a batch is padded to its longest row, and each vector is
put back at its input's index: the answer keeps the request's order. The worker keeps one embedding model
open (`EncoderShelf`), beside the model pool, with a keep_alive as the pool's models have; the pool's memory
plan counts it as a loaded model (idle, it may be closed to make room for a load, as an idle model is).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models.convert.encoder_config import GRAPHS
from models.runtime.embedder import MAX_BATCH, Embedder, opened_variant
from models.runtime.engine import release_freed_memory
from models.types import CancelToken
from server.serving.contracts import Gate, Sink
from server.serving.events import Failed

log = logging.getLogger("simmer.pool")

# Inputs per request. Each is checked and tokenized before the first pass, and every vector is held until
# the last batch: 256 inputs of 384 floats is 400 KB; at 32 rows a pass, 8 turns of the worker.
MAX_EMBED_INPUTS = 256


def by_length(rows: Sequence[Sequence[int]]) -> list[int]:
    """The rows' indices, shortest row first (equal lengths keep the request's order). Batches cut from this
    order pad little: on 256 varied sentences, batches of 32 in request order run 2.22x the real tokens,
    in this order 1.14x. The whole request is ordered at once, not window by window: it is at most
    MAX_EMBED_INPUTS rows, all tokenized before the first pass anyway."""
    return sorted(range(len(rows)), key=lambda i: len(rows[i]))


@dataclass(frozen=True)
class Embedded:
    """The job's answer: one vector per input, in order, and the tokens they held."""

    vectors: np.ndarray  # [inputs, dimensions] float32
    prompt_tokens: int


@dataclass(frozen=True)
class EncoderView:
    """The open embedding model, as /api/ps and the memory plan see it."""

    model_id: str
    bytes: int  # its files on disk but the other variants' graphs: the weights its session holds, read whole
    expires_in_s: float | None  # None: kept until the server stops
    last_used: float  # on the pool's clock
    busy: bool  # a job uses it now


class EncoderShelf:
    """The embedding model the worker has open: opened on first use, replaced when another is asked for, and
    closed once idle past its keep_alive (the request's, else SIMMER_KEEP_ALIVE_S; 0: after the request), as
    a generation model is. Worker thread only, except `view` (any thread: one tuple read)."""

    def __init__(
        self,
        threads: int = 1,
        keep_alive_s: float = math.inf,
        clock=time.monotonic,
        variant: str | None = None,
    ) -> None:
        self.threads = threads
        # SIMMER_VARIANT: each model opens on it where it has it (models/runtime/embedder.py's opened_variant)
        self.variant = variant
        self.keep_alive_s = keep_alive_s
        self._clock = clock
        self._open: tuple[str, Path, Embedder, int] | None = None
        self._expires_at = math.inf  # while a job uses it, and for ever by default
        self._busy = False
        self._last_used = clock()

    def get(self, model_id: str, path: Path) -> Embedder:
        if self._open is None or self._open[:2] != (model_id, path):
            self._open = None  # the old session goes before the new one loads
            emb = Embedder(path, threads=self.threads, variant=opened_variant(path, self.variant))
            # the folder may hold both variants' graphs; the session reads only the one it opened
            others = {f"{g}{tail}" for v, g in GRAPHS.items() if v != emb.variant for tail in ("", ".data")}
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name not in others)
            self._open = (model_id, path, emb, size)
        self._expires_at = math.inf  # not while it serves
        self._busy, self._last_used = True, self._clock()
        return self._open[2]

    def done(self, keep_alive_s: float | None) -> None:
        """A job is over: the model stays open for its keep_alive (None: the default; 0 closes it now)."""
        keep = self.keep_alive_s if keep_alive_s is None else keep_alive_s
        self._busy, self._last_used = False, self._clock()
        if keep <= 0:
            self.close("keep_alive 0: closed after the request")
        elif self._open is not None:
            self._expires_at = self._clock() + keep if keep != math.inf else math.inf

    def next_expiry(self) -> float | None:
        return None if self._open is None or self._expires_at == math.inf else self._expires_at

    def expire(self) -> None:
        if self._open is not None and self._expires_at <= self._clock():
            self.close("idle past its keep_alive")

    def close(self, reason: str) -> None:
        if self._open is not None:
            log.info("closed the embedding model %s: %s", self._open[0], reason)
        self._open = None
        release_freed_memory()

    def view(self) -> EncoderView | None:
        opened, expires_at = self._open, self._expires_at
        if opened is None:
            return None
        left = None if expires_at == math.inf else max(0.0, expires_at - self._clock())
        return EncoderView(opened[0], opened[3], left, self._last_used, self._busy)


@dataclass
class EmbedJob:
    id: str
    model_id: str
    path: Path  # the model's installed folder
    inputs: list[str] | list[list[int]]
    sink: Sink
    param: str = "input"  # the request's name for the inputs, which a refusal names
    fit: bool = False  # texts over the context cut to fit (Ollama's truncate) rather than refused
    keep_alive_s: float | None = None  # how long the model stays open after it (None: SIMMER_KEEP_ALIVE_S)
    cancel: CancelToken = field(default_factory=CancelToken)
    enqueued_at: float = field(default_factory=time.monotonic)
    rows: list[list[int]] | None = None  # tokenized and checked, on the worker; in the request's order
    order: list[int] = field(default_factory=list)  # the rows' indices in the order the batches take them
    parts: list[np.ndarray] = field(default_factory=list)  # each batch's vectors, rows in `order`
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
                encoder.check(rows, param=self.param)  # in the request's order: a refusal names its index
                self.order = by_length(rows)
                self.rows = rows
            start = self.done_rows
            batch = [self.rows[i] for i in self.order[start : start + MAX_BATCH]]
            began = time.monotonic()
            self.parts.append(encoder.embed(batch))
            self.pass_s = time.monotonic() - began
        except Exception as err:  # a refusal (SimmerError) or the engine's own failure: the job's answer
            self.sink(Failed(err))
            return True
        if self.done_rows < len(self.rows):
            return False
        ordered = np.concatenate(self.parts)
        vectors = np.empty_like(ordered)
        vectors[self.order] = ordered  # each vector back at its input's index
        self.sink(Embedded(vectors, sum(len(r) for r in self.rows)))
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
