"""The coalescer's rule with a fake clock: first token at once, then at most one flush per interval."""

from __future__ import annotations

import itertools

from models.types import TokenEvent
from server.api.common.streaming import Coalescer


def tok(i: int, text: str = "x") -> TokenEvent:
    return TokenEvent(token_id=i, text=text, index=i)


def test_coalescer_when_first_token_then_sent_at_once() -> None:
    c = Coalescer(0.05)
    assert c.add(tok(0, "Hi"), now=10.0) == [tok(0, "Hi")]


def test_coalescer_when_first_token_text_held_back_then_waits_for_visible_text() -> None:
    c = Coalescer(0.05)
    assert c.add(tok(0, ""), now=10.0) is None
    assert c.add(tok(1, "é"), now=10.001) == [tok(0, ""), tok(1, "é")]


def test_coalescer_when_tokens_inside_interval_then_held_until_deadline() -> None:
    c = Coalescer(0.05)
    c.add(tok(0), now=0.0)
    assert c.add(tok(1), now=0.01) is None
    assert c.add(tok(2), now=0.02) is None
    assert c.deadline() == 0.05
    assert c.flush(now=0.05) == [tok(1), tok(2)]
    assert c.deadline() is None


def test_coalescer_when_token_arrives_after_interval_then_flushes_batch() -> None:
    c = Coalescer(0.05)
    c.add(tok(0), now=0.0)
    assert c.add(tok(1), now=0.03) is None
    assert c.add(tok(2), now=0.06) == [tok(1), tok(2)]
    # the next window starts from that flush
    assert c.add(tok(3), now=0.08) is None
    assert c.deadline() == 0.11


def test_coalescer_when_simulated_fast_stream_then_flushes_are_interval_apart() -> None:
    c = Coalescer(0.05)
    flush_times = []
    now = 0.0
    for i in range(200):  # 2 ms per token for 400 ms
        now = i * 0.002
        deadline = c.deadline()
        if deadline is not None and deadline <= now and c.flush(deadline):
            flush_times.append(deadline)
        if c.add(tok(i), now):
            flush_times.append(now)
    gaps = [b - a for a, b in itertools.pairwise(flush_times)]
    assert len(flush_times) < 20
    assert all(g >= 0.05 - 1e-9 for g in gaps)


def test_coalescer_when_stream_ends_then_flush_returns_everything_held() -> None:
    c = Coalescer(0.05)
    c.add(tok(0), now=0.0)
    c.add(tok(1), now=0.001)
    c.add(tok(2), now=0.002)
    assert c.flush(now=0.003) == [tok(1), tok(2)]
    assert c.flush(now=0.004) == []
