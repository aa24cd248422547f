"""The worker's embedding queue: a job of several batches gives the worker back between them, so a
generation job that arrives meanwhile runs before the embedding's last batch (server/serving/embedding.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from server.refusals import ModelLoading
from server.serving.embedding import Embedded, EmbedJob, EncoderShelf
from server.serving.events import Failed
from tests.server.conftest import wait_ready


@dataclass
class CountingEmbedJob(EmbedJob):
    """An embedding job of `batches` passes that notes, at each pass, how many replies the engine has begun;
    its first pass waits (bounded) for a generation job to be queued behind it."""

    batches: int = 3
    queued: threading.Event = field(default_factory=threading.Event)
    running: threading.Event = field(default_factory=threading.Event)  # its first pass has begun
    seen: list[int] = field(default_factory=list)
    engine_generations: list = field(default_factory=list)

    def step(self, shelf: EncoderShelf) -> bool:
        if not self.seen:
            self.running.set()
            self.queued.wait(60)
        self.seen.append(len(self.engine_generations))
        if len(self.seen) < self.batches:
            return False
        self.sink(Embedded(np.zeros((1, 4), np.float32), 1))
        return True


def test_embedding_when_generation_arrives_mid_job_then_it_runs_between_batches(live):
    srv = live()
    wait_ready(srv)  # the worker takes jobs once its model is loaded
    worker = srv.app.state.runtime.worker
    answers: list[object] = []
    job = CountingEmbedJob(
        id="embd-test",
        model_id="unused",
        path=Path("unused"),
        inputs=["x"],
        sink=answers.append,
        engine_generations=srv.engine.generations,
    )
    worker.submit_embedding(job)
    reply: list[httpx.Response] = []
    chat = threading.Thread(
        target=lambda: reply.append(
            httpx.post(
                srv.url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                timeout=60,
            )
        )
    )
    # the job must be off the queue first: queue_depth counts a waiting embedding job too
    assert job.running.wait(60), "the embedding job never began"
    chat.start()
    deadline = time.monotonic() + 60  # a robust bound: the machine may be loaded
    while worker.queue_depth < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # until the chat job waits in the queue behind the running embedding pass
    queued = worker.queue_depth >= 1
    job.queued.set()
    chat.join(60)
    deadline = time.monotonic() + 60
    while not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert queued, "the chat job never reached the queue"
    assert reply and reply[0].status_code == 200
    assert len(answers) == 1 and isinstance(answers[0], Embedded)
    # pass 1 before the chat began; the chat ran before pass 2 (not after the job's last pass)
    assert job.seen == [0, 1, 1]


def test_embedding_when_the_start_model_failed_to_load_then_the_worker_still_serves(live):
    def broken():
        raise RuntimeError("no weights")

    srv = live(engine_factory=broken)
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 60
    while worker.start_load()[0] != "failed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert str(worker.start_load()[1]) == "no weights"
    assert httpx.get(srv.url + "/health").json()["status"] == "error"
    answers: list = []
    job = EmbedJob(id="embd-test", model_id="unused", path=Path("unused"), inputs=["x"], sink=answers.append)
    worker.submit_embedding(job)  # a failed start load ends no thread: the encoder is another model
    while not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers and isinstance(answers[0], Failed) and not isinstance(answers[0].error, ModelLoading)
