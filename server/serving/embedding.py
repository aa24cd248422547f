"""Embeddings on the worker thread: an `EmbedJob` is a request's inputs for one embedding model, run a
bounded step at a time, so a large request never holds the worker for long while others wait:
- between generation jobs, a step is a batch of at most models/runtime/embedder.py's MAX_BATCH rows (or a
  chunk of inputs tokenized); the worker puts the job back at the end of its embedding queue and
  alternates it with generation jobs;
- while replies stream, a step runs between two of their passes (a slice) and is sized to last about as
  long as one of those passes (`PassGaps` measures them; `rows_within` sizes the batch from the job's own
  measured cost per token), so a reader's next token waits at most about twice its usual gap.

The inputs are tokenized (strings) and checked (every row: ids in the vocabulary, within the context) on
the worker before the first pass, a chunk per step, so a request is answered whole or refused whole. The
batches are then cut from the rows ordered by length (`by_length`), as a batch is padded to its longest
row, and each vector is put back at its input's index: the answer keeps the request's order. The worker
keeps one embedding model open (`EncoderShelf`), beside the model pool, with a keep_alive as the pool's
models have; the pool's memory plan counts it as a loaded model (idle, it may be closed to make room for a
load, as an idle model is).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import threading
import time
from collections.abc import Sequence, Sized
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
# the last batch: 8,192 inputs of 384 floats is 12.6 MB (their JSON about 60 MB, built a row at a time off
# the event loop); the request body's own cap (SIMMER_MAX_BODY_BYTES) usually bounds it first.
MAX_EMBED_INPUTS = 8192
# Texts tokenized per step between jobs: 512 short sentences are a few milliseconds of WordPiece. In a slice
# as many as its budget allows at the job's measured cost per text (SLICE_TEXTS while that is unknown).
TOKENIZE_CHUNK = 512
SLICE_TEXTS = 32
# A slice between two passes of running replies lasts about this share of their median pass: the reader's
# next token then waits under 2x its usual gap.
SLICE_SHARE = 0.6


def by_length(rows: Sequence[Sized]) -> list[int]:
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
    a generation model is. While replies stream, `ready` opens it beside the worker (building a session is
    not inference; the reader's tokens go on meanwhile). Worker thread only, except `view` (any thread: one
    tuple read) and the opening thread's hand-over (under the lock)."""

    def __init__(
        self,
        threads: int = 1,
        keep_alive_s: float = math.inf,
        clock=time.monotonic,
        variant: str | None = None,
    ) -> None:
        self.max_threads = self.threads = threads  # the setting's; the governor's limit may lower `threads`
        # SIMMER_VARIANT: each model opens on it where it has it (models/runtime/embedder.py's opened_variant)
        self.variant = variant
        self.keep_alive_s = keep_alive_s
        self._clock = clock
        self._open: tuple[str, Path, Embedder, int] | None = None
        self._open_threads = threads  # the open session's pool (onnxruntime fixes it when it builds one)
        self._expires_at = math.inf  # while a job uses it, and for ever by default
        self._busy = False
        self._last_used = clock()
        self._lock = threading.Lock()
        self._opening: tuple[str, Path] | None = None  # opened beside the worker now
        self._opened: tuple[str, Path, Embedder | BaseException] | None = None  # and done, not taken yet
        self._opened_threads = threads

    def limit_threads(self, limit: int | None) -> None:
        """The governor's thread limit (None: none): the encoder's next session uses no more, and the open
        one is built again at the next `get` when its pool differs (a few hundred milliseconds for MiniLM,
        and the limit moves rarely: the governor holds a thread count for a while)."""
        self.threads = self.max_threads if limit is None else max(1, min(self.max_threads, limit))

    def get(self, model_id: str, path: Path) -> Embedder:
        if self._open is not None and self._open_threads != self.threads:
            log.info("the embedding model %s goes to %d threads", self._open[0], self.threads)
            self._open = None
        if self._open is None or self._open[:2] != (model_id, path):
            self._open = None  # the old session goes before the new one loads
            self._open_threads = self.threads
            emb = self._take(model_id, path)
            # the folder may hold both variants' graphs; the session reads only the one it opened
            others = {f"{g}{tail}" for v, g in GRAPHS.items() if v != emb.variant for tail in ("", ".data")}
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name not in others)
            self._open = (model_id, path, emb, size)
        self._expires_at = math.inf  # not while it serves
        self._busy, self._last_used = True, self._clock()
        return self._open[2]

    def ready(self, model_id: str, path: Path) -> bool:
        """Whether `get` would answer without opening the model on the worker: it is open, or was opened
        beside it (or failed to: `get` then raises the error). Else its opening starts beside the worker."""
        if (
            self._open is not None
            and self._open[:2] == (model_id, path)
            and self._open_threads == self.threads
        ):
            return True
        with self._lock:
            if self._opened is not None and self._opened[:2] == (model_id, path):
                return True
            if self._opening is None:
                self._opening = (model_id, path)
                self._opened_threads = self.threads
                threading.Thread(
                    target=self._open_beside,
                    args=(model_id, path, self.threads),
                    name="simmer-encoder-open",
                    daemon=True,
                ).start()
        return False

    def _open_beside(self, model_id: str, path: Path, threads: int) -> None:
        try:
            opened: Embedder | BaseException = self._embedder(path, threads)
        except Exception as err:  # the job that asked gets it from get()
            opened = err
        with self._lock:
            self._opening, self._opened = None, (model_id, path, opened)

    def _take(self, model_id: str, path: Path) -> Embedder:
        """The model opened beside the worker if that is the one, else opened here."""
        with self._lock:
            opened, self._opened = self._opened, None
        if opened is not None and opened[:2] == (model_id, path) and self._opened_threads == self.threads:
            if isinstance(opened[2], BaseException):
                raise opened[2]
            return opened[2]
        return self._embedder(path, self.threads)

    def _embedder(self, path: Path, threads: int) -> Embedder:
        return Embedder(path, threads=threads, variant=opened_variant(path, self.variant))

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
        with self._lock:
            self._opened = None  # one opened beside the worker and not taken yet goes too
        release_freed_memory()

    def view(self) -> EncoderView | None:
        opened, expires_at = self._open, self._expires_at
        if opened is None:
            return None
        left = None if expires_at == math.inf else max(0.0, expires_at - self._clock())
        return EncoderView(opened[0], opened[3], left, self._last_used, self._busy)


def rows_within(widths: Sequence[int], budget_s: float | None, s_per_token: float | None) -> int:
    """How many of the next rows (their lengths, shortest first) one pass takes: MAX_BATCH without a budget;
    with one, as many as fit it at the job's measured cost per padded token (a pass pads every row to the
    last one's length), at least one; one row while the cost is unknown (the first pass measures it)."""
    if budget_s is None:
        return min(MAX_BATCH, len(widths))
    if s_per_token is None:
        return 1
    n = 1
    while n < min(MAX_BATCH, len(widths)) and (n + 1) * widths[n] * s_per_token <= budget_s:
        n += 1
    return n


class PassGaps:
    """The time between two passes of the replies running now, which sizes an embedding slice (worker
    thread). A slice's own time is not a gap: `restart` after it. `clear` when other replies start (another
    model's passes take another time)."""

    def __init__(self, keep: int = 9, least: int = 3) -> None:
        self._gaps: collections.deque[float] = collections.deque(maxlen=keep)
        self._least = least  # gaps seen before a slice runs: the first ones hold a prefill
        self._since: float | None = None

    def note(self, now: float) -> None:
        if self._since is not None:
            self._gaps.append(now - self._since)
        self._since = now

    def restart(self, now: float) -> None:
        self._since = now

    def clear(self) -> None:
        self._gaps.clear()
        self._since = None

    def budget(self) -> float | None:
        """SLICE_SHARE of the median gap; None until `least` gaps were seen."""
        if len(self._gaps) < self._least:
            return None
        return SLICE_SHARE * statistics.median(self._gaps)


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
    rows: list[np.ndarray] = field(default_factory=list)  # tokenized and checked so far, in request order
    order: list[int] = field(default_factory=list)  # the rows' indices in the order the batches take them
    parts: list[np.ndarray] = field(default_factory=list)  # each batch's vectors, rows in `order`
    batches_run: int = 0  # gated_step counts them
    pass_s: float | None = None  # the last batch's forward pass, for the governor's CPU budget
    s_per_token: float | None = None  # the last pass's seconds per padded token: sizes a slice
    s_per_text: float | None = None  # the last chunk's seconds of tokenizing per text: sizes a slice

    @property
    def done_rows(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def tokenized(self) -> bool:
        return len(self.rows) == len(self.inputs)

    def step(self, shelf: EncoderShelf, budget_s: float | None = None) -> bool:
        """One step on the worker thread: a chunk of inputs tokenized and checked, else one batch (as many
        rows as `budget_s` allows: rows_within). True when the job is over: answered, failed or its client
        gone."""
        if self.cancel.cancelled:
            return True
        try:
            encoder = shelf.get(self.model_id, self.path)
            if not self.tokenized:
                self._tokenize(encoder, budget_s)
                return False
            start = self.done_rows
            take = self.order[start : start + MAX_BATCH]
            n = rows_within([len(self.rows[i]) for i in take], budget_s, self.s_per_token)
            batch = [self.rows[i].tolist() for i in take[:n]]
            began = time.monotonic()
            self.parts.append(encoder.embed(batch))
            self.pass_s = time.monotonic() - began
            self.s_per_token = self.pass_s / (len(batch) * len(batch[-1]))
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

    def _tokenize(self, encoder: Embedder, budget_s: float | None) -> None:
        """The next inputs as rows (TOKENIZE_CHUNK of them, or what a slice's budget allows), checked (a
        refusal names the input's index in the request); once all are, the order the batches take them in."""
        first = len(self.rows)
        n = TOKENIZE_CHUNK
        if budget_s is not None:
            n = SLICE_TEXTS if self.s_per_text is None else int(budget_s / self.s_per_text)
            n = max(1, min(TOKENIZE_CHUNK, n))
        chunk = self.inputs[first : first + n]
        began = time.monotonic()
        texts = [x for x in chunk if isinstance(x, str)]
        rows = (
            encoder.tokenize(texts, fit=self.fit)
            if texts
            else [list(x) for x in chunk if not isinstance(x, str)]
        )
        encoder.check(rows, param=self.param, first=first)
        self.s_per_text = (time.monotonic() - began) / len(chunk)
        # int32 arrays, not lists of ints (36 bytes a token): a request's rows wait in memory while it
        # takes turns with the others queued, and a body's worth of tokens is up to a million
        self.rows.extend(np.asarray(r, np.int32) for r in rows)
        if self.tokenized:
            self.order = by_length(self.rows)


def gated_step(job: EmbedJob, shelf: EncoderShelf, gate: Gate) -> bool:
    """The job's next batch behind the governor's gate (Gate.before_batch): paused while the governor
    pauses (new work before the first batch, running work after), idled after a pass for the CPU budget,
    failed when the pause outlasts its timeout or the device stopped the app, and run on no more threads
    than the governor's limit. True when the job is over."""
    try:
        threads = gate.before_batch(job.cancel, job.enqueued_at, job.pass_s if job.batches_run else None)
    except Exception as err:  # device_paused, device_overheated, cancelled: the job's answer
        job.sink(Failed(err))
        return True
    shelf.limit_threads(threads)
    job.batches_run += 1
    return job.step(shelf)
