"""Every request's log line says what really happened (prompt tokens, tokens produced and sent, variant,
TTFT), however it ended, and /metrics' token totals are exactly the sum of the log lines."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import httpx
import pytest

from models.types import FinishEvent, Timings, TokenEvent, Usage
from server.logs import TEXT_LOGGERS, setup_logging
from server.serving.accounting import RequestAccount
from tests.server.conftest import MODEL
from tests.server.fakes import REPLY
from tests.server.helpers import metric, queue_depth, request_lines, wait_until

SECRET = "zebra-violet-7781"  # in every prompt: must never reach a log line
MSG = [{"role": "user", "content": f"tell me about {SECRET}"}]


def chat(max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": max_tokens, "stream": stream}


def first_chunks(srv, body: dict, n: int, into: list | None = None) -> None:
    """Open a stream, read `n` data lines, then hang up."""
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _, line in zip(range(n), lines, strict=False):
            if into is not None:
                into.append(line)


def test_logs_when_mix_of_complete_cut_disconnected_failed_and_shutdown_then_metrics_equal_sum_of_lines(
    live, caplog
) -> None:
    srv = live(token_delay_s=0.01, reply_tokens=100_000)
    caplog.set_level(logging.INFO)
    with srv.client() as c:
        assert c.post("/v1/chat/completions", json=chat(5)).status_code == 200  # complete
        with c.stream("POST", "/v1/chat/completions", json=chat(6, stream=True)) as r:  # complete, streamed
            assert list(r.iter_lines())[-2] == "data: [DONE]"
    first_chunks(srv, chat(10_000, stream=True), 3)  # stream cut early
    assert srv.engine.wait_for(lambda g: len(g) == 3 and g[-1].finish is not None)
    with contextlib.suppress(httpx.TimeoutException):  # non-stream client that gives up
        httpx.post(srv.url + "/v1/chat/completions", json=chat(10_000), timeout=0.3)
    assert srv.engine.wait_for(lambda g: len(g) == 4 and g[-1].finish is not None)
    srv.engine.fail_after_tokens = 4  # the engine fails after tokens were streamed
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(100, stream=True)) as r:
        assert '"internal_error"' in r.read().decode()
    srv.engine.fail_after_tokens = None

    # shutdown: one stream mid-reply, one still queued
    seen: list[str] = []
    running = threading.Thread(target=first_chunks, args=(srv, chat(10_000, stream=True), 10**6, seen))
    queued = threading.Thread(target=first_chunks, args=(srv, chat(10_000, stream=True), 10**6))
    running.start()
    assert wait_until(lambda: len(seen) >= 3)
    queued.start()
    assert wait_until(lambda: queue_depth(srv) == 1)
    srv.app.state.runtime.worker.close()  # what SIGTERM does first
    for t in (running, queued):
        t.join(10)
    assert wait_until(lambda: len(request_lines(caplog)) == 7)

    lines = request_lines(caplog)
    outcomes = sorted(line["outcome"] for line in lines)
    assert outcomes == sorted(
        ["length", "length", "client_gone", "client_gone", "internal_error"] + ["server_shutting_down"] * 2
    )
    by_outcome = {line["outcome"]: line for line in lines}
    for line in lines:
        if line["completion_tokens"]:  # anything that ran says so, whatever ended it
            assert line["prompt_tokens"] > 0 and line["variant"] == "q4" and line["ttft_ms"] > 0
    assert by_outcome["internal_error"]["completion_tokens"] == 4
    assert by_outcome["internal_error"]["sent_tokens"] == 4
    gone = [line for line in lines if line["outcome"] == "client_gone"]
    assert all(line["completion_tokens"] > 0 for line in gone)
    shut = [line for line in lines if line["outcome"] == "server_shutting_down"]
    assert sorted(line["completion_tokens"] > 0 for line in shut) == [False, True]  # running, queued

    assert metric(srv, "simmer_prompt_tokens_total") == sum(line["prompt_tokens"] for line in lines)
    assert metric(srv, "simmer_generated_tokens_total") == sum(line["completion_tokens"] for line in lines)
    produced = sum(g.tokens for g in srv.engine.generations)  # what the engine really yielded
    assert metric(srv, "simmer_generated_tokens_total") == produced
    text = "\n".join(r.getMessage() + str(getattr(r, "fields", "")) for r in caplog.records)
    assert SECRET not in text and "quick brown" not in text and REPLY.split()[3] not in text


def _finish(prompt: int, completion: int) -> FinishEvent:
    timings = Timings(ttft_ms=12.0, predicted_per_second=40.0)
    return FinishEvent("cancelled", Usage(prompt, completion), timings, variant="q4")


def test_account_when_both_halves_in_then_written_once_whatever_the_order() -> None:
    written: list = []
    for route_first in (True, False):
        written.clear()
        acct = RequestAccount(id="x", endpoint="chat", model="m", stream=True, emit=written.append)
        acct.started(9, "q4")
        acct.token(TokenEvent(1, "a", 0, elapsed_ms=20.0))
        acct.token(TokenEvent(2, "b", 1, elapsed_ms=45.0))
        if route_first:
            acct.route_done("client_gone", 1)
            assert written == []  # the worker may still produce a token
            acct.token(TokenEvent(3, "c", 2, elapsed_ms=70.0))
            acct.worker_done()
        else:
            acct.worker_done()
            assert written == []
            acct.route_done("client_gone", 1)
        acct.route_done("stop", 99)  # a second report does not count
        acct.worker_done()
        assert len(written) == 1
        rec = written[0]
        assert (rec.prompt_tokens, rec.sent_tokens, rec.variant, rec.ttft_ms) == (9, 1, "q4", 20.0)
        assert rec.completion_tokens == (3 if route_first else 2)
        assert rec.outcome == "client_gone" and rec.tokens_per_s > 0


def test_account_when_finish_event_then_its_usage_and_timings_count() -> None:
    written: list = []
    acct = RequestAccount(id="x", endpoint="chat", model="m", stream=False, emit=written.append)
    acct.started(9, "q4")
    acct.finished(_finish(9, 0))
    acct.route_done("client_gone", 0)
    acct.worker_done()
    assert (written[0].completion_tokens, written[0].ttft_ms) == (0, 12.0)


@pytest.fixture
def debug_logging() -> Iterator[None]:
    """setup_logging("debug") as `SIMMER_LOG_LEVEL=debug simmer serve` does; the root logger restored."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, {n: logging.getLogger(n).level for n in TEXT_LOGGERS})
    setup_logging("debug", json_lines=True)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_logs_when_debug_level_then_no_prompt_or_reply_text_anywhere(live, debug_logging, capsys) -> None:
    srv = live(token_delay_s=0.0, reply_tokens=20)
    with srv.client() as c:
        assert c.post("/v1/chat/completions", json=chat(8)).status_code == 200
        with c.stream("POST", "/v1/chat/completions", json=chat(8, stream=True)) as r:
            assert "quick brown" in r.read().decode()  # the reply did carry the text
    srv.stop()
    err = capsys.readouterr().err
    assert err.count("outcome=length") == 2  # the request lines are there, and debug lines too
    assert '"level": "debug"' in err
    assert SECRET not in err and "quick brown" not in err


def cut_after(srv, path: str, body: dict, n: int, marker: str) -> None:
    """Read `n` lines of a stream (any dialect) that carry `marker` (a token's text), then hang up."""
    with srv.client() as c, c.stream("POST", path, json=body) as r:
        lines = (line for line in r.iter_lines() if marker in line)
        for _ in zip(range(n), lines, strict=False):
            pass


def test_logs_when_ollama_and_responses_dialects_then_one_line_each_and_metrics_equal_sum(
    live, caplog
) -> None:
    """Every dialect runs on the one generation flow: Ollama's /api/chat and /api/generate and the Responses
    API, complete and cut, are accounted like the OpenAI routes."""
    srv = live(token_delay_s=0.01, reply_tokens=100_000)
    caplog.set_level(logging.INFO)
    ollama_chat = {"model": MODEL, "messages": MSG, "options": {"num_predict": 5}}
    with srv.client() as c:
        assert c.post("/api/chat", json={**ollama_chat, "stream": False}).status_code == 200
        assert c.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False,
                                             "options": {"num_predict": 4}}).status_code == 200  # fmt: skip
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 6})
        assert r.status_code == 200, r.text
    cut_after(srv, "/api/chat", {**ollama_chat, "options": {"num_predict": 10_000}}, 3, '"done":false')
    assert srv.engine.wait_for(lambda g: len(g) == 4 and g[-1].finish is not None)
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 10_000, "stream": True}
    cut_after(srv, "/v1/responses", body, 3, "output_text.delta")
    assert srv.engine.wait_for(lambda g: len(g) == 5 and g[-1].finish is not None)
    assert wait_until(lambda: len(request_lines(caplog)) == 5)
    lines = request_lines(caplog)
    assert sorted(line["endpoint"] for line in lines) == [
        "api/chat", "api/chat", "api/generate", "responses", "responses"]  # fmt: skip
    gone = [line for line in lines if line["outcome"] == "client_gone"]
    assert len(gone) == 2 and all(line["completion_tokens"] > 0 for line in gone)
    assert metric(srv, "simmer_prompt_tokens_total") == sum(line["prompt_tokens"] for line in lines)
    assert metric(srv, "simmer_generated_tokens_total") == sum(line["completion_tokens"] for line in lines)
    assert metric(srv, "simmer_generated_tokens_total") == sum(g.tokens for g in srv.engine.generations)


def test_logs_when_client_leaves_a_stream_of_two_choices_then_both_stop_as_client_gone(live, caplog) -> None:
    """n = 2 streamed, the client hangs up after a few chunks of choice 0: the running reply stops, the
    queued one never runs (or stops), and each has its own client_gone line."""
    srv = live(token_delay_s=0.01, reply_tokens=100_000)
    caplog.set_level(logging.INFO)
    seen: list[str] = []
    first_chunks(srv, chat(10_000, stream=True) | {"n": 2}, 4, seen)
    assert wait_until(lambda: len(request_lines(caplog)) == 2)
    lines = request_lines(caplog)
    assert [line["outcome"] for line in lines] == ["client_gone", "client_gone"]
    assert srv.engine.wait_for(lambda g: all(x.finish is not None for x in g))
    assert len(srv.engine.generations) <= 2 and sum(g.tokens for g in srv.engine.generations) < 1000
