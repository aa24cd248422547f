"""Embedding work while replies stream: a slice between two of their passes, sized to about one pass
(server/serving/embedding.py's PassGaps and rows_within; Worker.between_tokens)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest

from models.runtime.embedder import MAX_BATCH
from server.serving.embedding import SLICE_SHARE, Embedded, EmbedJob, EncoderShelf, PassGaps, rows_within
from tests.server.conftest import wait_ready


# rows_within's table: (row lengths shortest first, budget, seconds per padded token) -> rows in the pass
@pytest.mark.parametrize(
    ("widths", "budget_s", "s_per_token", "rows"),
    [
        ([10] * 40, None, None, MAX_BATCH),  # between jobs: a whole batch
        ([10] * 5, None, None, 5),  # the last rows
        ([10] * 40, 0.01, None, 1),  # cost unknown yet: one row measures it
        ([10] * 40, 0.01, 0.0001, 10),  # 10 rows x 10 tokens x 0.1 ms = 10 ms
        ([10, 10, 10, 50, 50], 0.01, 0.0001, 3),  # the fourth row pads all four to 50: 20 ms
        ([10] * 40, 0.5, 0.0001, MAX_BATCH),  # never more than a batch
        ([300] * 4, 0.001, 0.0001, 1),  # one row over the budget still runs: the job goes on
    ],
)
def test_rows_within_table(widths, budget_s, s_per_token, rows):
    assert rows_within(widths, budget_s, s_per_token) == rows


def test_pass_gaps_when_fewer_than_three_gaps_then_no_budget_and_a_slice_is_no_gap():
    gaps = PassGaps()
    for t in (0.0, 0.010, 0.020):
        gaps.note(t)
    assert gaps.budget() is None  # two gaps: the first holds a prefill
    gaps.note(0.030)
    assert gaps.budget() == pytest.approx(SLICE_SHARE * 0.010)
    gaps.restart(0.050)  # a 20 ms slice ran after the pass that ended at 0.030
    gaps.note(0.060)
    assert gaps.budget() == pytest.approx(SLICE_SHARE * 0.010)
    gaps.clear()
    assert gaps.budget() is None


@dataclass
class SlicedJob(EmbedJob):
    """An embedding job of `steps` steps, each taking its budget (a whole batch's 50 ms without one), that
    notes each step's budget and how many tokens the chat had streamed then."""

    steps: int = 12
    budgets: list[float | None] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=lambda: [0])

    def step(self, shelf: EncoderShelf, budget_s: float | None = None) -> bool:
        self.budgets.append(budget_s)
        self.streamed.append(self.tokens[0])
        time.sleep(budget_s if budget_s is not None else 0.05)
        if len(self.budgets) < self.steps:
            return False
        self.sink(Embedded(np.zeros((1, 4), np.float32), 1))
        return True


def test_embedding_when_a_reply_streams_then_its_steps_run_between_tokens_within_a_pass(live, tmp_path):
    delay, reply_tokens = 0.03, 60
    srv = live(token_delay_s=delay, reply_tokens=reply_tokens, stream_interval_ms=0)  # a chunk a token
    wait_ready(srv)
    folder = tmp_path / "encoder"  # not an encoder: the shelf's opening beside the worker fails, unused
    folder.mkdir()
    answers: list[object] = []
    job = SlicedJob(id="embd-test", model_id="m", path=folder, inputs=["x"], sink=answers.append)
    body = {"prompt": "hi", "max_tokens": reply_tokens, "stream": True}
    submitted = threading.Event()
    times: list[float] = []
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                job.tokens[0] += 1
                if job.tokens[0] == 5 and not submitted.is_set():
                    srv.app.state.runtime.worker.submit_embedding(job)
                    submitted.set()
    assert len(times) >= reply_tokens  # a chunk a token, then the one that ends it
    assert answers and isinstance(answers[0], Embedded)
    assert job.streamed[-1] < reply_tokens  # every step ran while the reply still streamed
    assert all(b is not None for b in job.budgets)  # each a slice between two passes, none a whole batch
    # a slice lasts SLICE_SHARE of the passes' median gap: at least the fake engine's delay between tokens
    assert min(b for b in job.budgets if b is not None) >= SLICE_SHARE * delay * 0.9


def test_embedding_when_no_reply_streams_then_steps_are_whole_batches(live, tmp_path):
    srv = live()
    wait_ready(srv)
    answers: list[object] = []
    job = SlicedJob(id="embd-test", model_id="m", path=tmp_path, inputs=["x"], sink=answers.append, steps=3)
    srv.app.state.runtime.worker.submit_embedding(job)
    deadline = time.monotonic() + 30
    while not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers and job.budgets == [None, None, None]
