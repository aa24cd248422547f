"""Replies taking turns over HTTP (models/runtime/turns.py driven by server/serving/batch_loop.py), on a live
server with the tiny real model, where the batch probe says a batch's rows differ (forced here, as AVX2
measures SmolLM2's q4-a8: `--batch-rows differ` runs the whole suite so). Turns are counted in events and
passes, never in seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from models.runtime import engine as engine_module
from models.runtime.batch import BatchTraits
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.turns import TurnDecoder
from models.types import TokenEvent
from tests.helpers import sdk
from tests.server.fakes import HoldGate, PaceGate

PROMPTS = ["the cat sat on the mat", "once upon a time", "what is the capital", "def fib(n):"]
SAMPLING: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 1.0, "seed": 5},
    {"temperature": 0, "frequency_penalty": 0.5},
    {"temperature": 1.2, "top_p": 0.9, "seed": 9},
]


@pytest.fixture
def rows_differ(monkeypatch) -> None:
    """The probe's answer on AVX2 for SmolLM2's q4-a8: a row beside others is not the row alone."""
    differ = BatchTraits(rows=True, rows_alike=False, one_row_exact=False)
    monkeypatch.setattr(engine_module, "batch_traits", lambda sess: differ)


@pytest.fixture
def log(monkeypatch) -> Iterator[list[tuple]]:
    """What every TurnDecoder did, in order: ("add", slot, max_tokens), ("token", slot) per token made,
    ("round", replies) per step that ran passes."""
    seen: list[tuple] = []
    add, prefill, step = TurnDecoder.add, TurnDecoder.prefill, TurnDecoder.step

    def tokens_of(events: list) -> None:
        seen.extend(("token", slot) for slot, ev in events if isinstance(ev, TokenEvent))

    def added(self, prompt, params, **kw):
        slot = add(self, prompt, params, **kw)
        seen.append(("add", slot, params.max_tokens))
        return slot

    def prefilled(self, slot=None):
        events = prefill(self, slot)
        tokens_of(events)
        return events

    def stepped(self):
        before = self.last_pass
        events = step(self)
        if self.last_pass is not before and self.last_pass is not None:
            seen.append(("round", self.last_pass.replies))
        tokens_of(events)
        return events

    monkeypatch.setattr(TurnDecoder, "add", added)
    monkeypatch.setattr(TurnDecoder, "prefill", prefilled)
    monkeypatch.setattr(TurnDecoder, "step", stepped)
    yield seen


def engine(folder, variant: str = "q4-a8") -> DecoderEngine:
    return load_engine(folder, variant=variant, threads=1, context_length=256, speculation="off")


SALTS = iter(range(1 << 30))


def stream(srv, i: int, max_tokens: int = 24) -> list:
    """Request i streamed: [(text, logprob, top logprobs)] per token, its whole prompt prefilled (a cache
    scope of its own)."""
    chunks = sdk(srv).chat.completions.create(
        model=srv.settings.model,
        messages=[{"role": "user", "content": PROMPTS[i % 4]}],
        max_tokens=max_tokens,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "cache_salt": f"request-{next(SALTS)}"},
        **SAMPLING[i % 4],
    )
    out = []
    for chunk in chunks:
        for choice in chunk.choices:
            for lp in (choice.logprobs and choice.logprobs.content) or []:
                out.append((lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]))
    return out


def queued(srv, gate: HoldGate, n: int) -> None:
    """Wait until the first job is held and n more are queued behind it."""
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 30
    while not (gate.holding.is_set() and worker.queue_depth == n):
        assert time.monotonic() < deadline, (gate.holding.is_set(), worker.queue_depth)
        time.sleep(0.01)


@pytest.mark.parametrize("variant", ["q4-a8", "q4"])
def test_turns_when_four_sdk_streams_at_once_then_each_is_its_reply_alone_bit_for_bit(
    live, tiny_model_dir, rows_differ, log, variant
):
    gate = HoldGate()
    e = engine(tiny_model_dir, variant)
    srv = live(engine=e, model=e.model_id, max_batch=4, governor=gate)
    one_reply = live(engine=engine(tiny_model_dir, variant), model=e.model_id, max_batch=1)
    alone = {i: stream(one_reply, i) for i in range(4)}  # SIMMER_MAX_BATCH=1: engine.generate
    assert not [x for x in log if x[0] == "round"]
    gate.release.clear()
    gate.holding.clear()
    out: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, stream(srv, i))) for i in range(4)]
    for t in threads:
        t.start()
    queued(srv, gate, 3)
    gate.release.set()
    for t in threads:
        t.join(60)
    assert isinstance(e._batch, TurnDecoder)
    assert max(x[1] for x in log if x[0] == "round") == 4  # they did take turns, four a round
    for i in range(4):
        assert len(out[i]) == 24
        assert out[i] == alone[i], i


def test_turns_when_a_short_request_comes_behind_three_long_replies_then_its_first_token_after_one_round(
    live, tiny_model_dir, rows_differ, log
):
    """Three replies of 200 tokens stream; a short request comes: its first token follows its prefill and
    at most one token of each running reply (one at a time, first in first out, it waited for all 600)."""
    gate = HoldGate()
    e = engine(tiny_model_dir)
    # paced so that the long replies still run when the short one comes, whatever the machine
    srv = live(engine=e, model=e.model_id, max_batch=4, governor=PaceGate(300, gate))
    gate.release.clear()
    gate.holding.clear()
    done: dict[int, list] = {}
    longs = [threading.Thread(target=lambda i=i: done.__setitem__(i, stream(srv, i, 200))) for i in range(3)]
    for t in longs:
        t.start()
    queued(srv, gate, 2)
    gate.release.set()
    deadline = time.monotonic() + 30
    while sum(1 for x in log if x[0] == "round") < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    done[3] = stream(srv, 3, 4)
    for t in longs:
        t.join(60)
    assert [len(done[i]) for i in range(4)] == [200, 200, 200, 4]
    joined = next(k for k, x in enumerate(log) if x[0] == "add" and x[2] == 4)
    short_slot = log[joined][1]
    first = next(k for k, x in enumerate(log) if k > joined and x == ("token", short_slot))
    between = [x[1] for x in log[joined:first] if x[0] == "token"]
    assert len(set(between)) == len(between) <= 3  # at most one token of each running reply


@pytest.mark.parametrize(("mode", "header"), [("exact", None), ("fast", "fast")])
def test_batch_mode_when_fast_then_each_local_reply_says_so_in_a_header(live, tiny_model_dir, mode, header):
    """SIMMER_BATCH=fast batches where a reply's text may depend on its neighbours: every local reply says
    so (X-Simmer-Batch: fast), streamed or not; exact, the default, adds nothing."""
    e = engine(tiny_model_dir)
    srv = live(engine=e, model=e.model_id, max_batch=4, batch=mode)
    body = {"model": e.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with srv.client() as c:
        plain = c.post("/v1/chat/completions", json=body)
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
            streamed.read()
    assert plain.status_code == streamed.status_code == 200
    assert plain.headers.get("x-simmer-batch") == streamed.headers.get("x-simmer-batch") == header
