"""The worker seen from outside: FIFO queue, overflow, cancellation on disconnect, stream timing,
errors inside streams, loading state and metrics."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import threading
import time

import httpx

from tests.server.conftest import MODEL
from tests.server.fakes import RecordingEngine, ScriptedEngine
from tests.server.helpers import queue_depth, wait_until

MSG = [{"role": "user", "content": "hello"}]


def chat(max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": max_tokens, "stream": stream, **extra}


def data_lines(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_worker_when_10_concurrent_clients_then_all_complete_in_fifo_order(live) -> None:
    # the context must hold the whole held reply: at 512 it ended after ~2.5 s, before a loaded machine
    # had queued all ten
    srv = live(token_delay_s=0.005, max_queue=16, reply_tokens=10_000, context_length=20_000)
    results: dict[int, httpx.Response] = {}

    def run(i: int) -> None:
        with srv.client() as c:
            results[i] = c.post("/v1/chat/completions", json=chat(4, seed=i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    # A streaming request holds the worker while clients arrive one at a time (a known arrival order).
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(10_000, stream=True)) as r:
        lines = r.iter_lines()
        next(lines)
        for i, t in enumerate(threads):
            t.start()
            assert wait_until(lambda i=i: queue_depth(srv) == i + 1)
    for t in threads:
        t.join(10)
    assert sorted(results) == list(range(10))
    assert all(r.status_code == 200 for r in results.values())
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results.values())
    seeds = [g.params.sampling.seed for g in srv.engine.generations]
    assert seeds == [None, *range(10)]


def test_worker_when_queue_full_then_503_server_busy_with_retry_after(live) -> None:
    srv = live(token_delay_s=0.02, max_queue=2, reply_tokens=10_000)
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(1000, stream=True)) as running:
        assert srv.engine.wait_for(lambda gens: len(gens) == 1)
        waiting = [
            threading.Thread(
                target=lambda: srv.client().post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            )
            for _ in range(2)
        ]
        for t in waiting:
            t.start()
        assert wait_until(lambda: queue_depth(srv) == 2)
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat(1))
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "server_busy" and err["type"] == "server_error"
        running.close()  # leave: the queued two get served, and the worker is free again
    for t in waiting:
        t.join(10)
    assert srv.engine.wait_for(lambda gens: len(gens) == 3 and all(g.finish for g in gens))


def test_worker_when_client_disconnects_mid_stream_then_generation_cancelled_within_one_token(live) -> None:
    srv = live(token_delay_s=0.01, reply_tokens=10_000)
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(10_000, stream=True)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # The connection is closed: the engine must stop, and within one token of the cancel.
    assert srv.engine.wait_for(lambda gens: gens[0].finish is not None)
    gen = srv.engine.generations[0]
    assert gen.finish.finish_reason == "cancelled"
    assert gen.tokens_at_cancel is not None
    assert gen.tokens - gen.tokens_at_cancel <= 1
    # And the worker takes the next request.
    follow = httpx.post(srv.url + "/v1/chat/completions", json=chat(2), timeout=5)
    assert follow.status_code == 200


def test_worker_when_client_disconnects_while_waiting_non_stream_then_cancelled(live) -> None:
    srv = live(token_delay_s=0.01, reply_tokens=10_000)
    with srv.client() as c, contextlib.suppress(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json=chat(10_000), timeout=0.3)
    assert srv.engine.wait_for(lambda gens: gens and gens[0].finish is not None)
    gen = srv.engine.generations[0]
    assert gen.finish.finish_reason == "cancelled"
    assert gen.tokens - gen.tokens_at_cancel <= 1


def test_worker_when_client_leaves_while_queued_then_job_never_runs(live) -> None:
    srv = live(token_delay_s=0.01, reply_tokens=10_000)
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(10_000, stream=True)) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the connection
        next(lines)
        with srv.client() as c2, contextlib.suppress(httpx.ReadTimeout):
            c2.post("/v1/chat/completions", json=chat(3, seed=7), timeout=0.3)
        assert wait_until(lambda: queue_depth(srv) == 0)
    assert srv.engine.wait_for(lambda gens: gens[0].finish is not None)
    httpx.post(srv.url + "/v1/chat/completions", json=chat(1, seed=8), timeout=5)
    assert [g.params.sampling.seed for g in srv.engine.generations] == [None, 8]


def test_stream_when_fast_engine_then_chunks_after_first_are_coalesced_about_50ms_apart(live) -> None:
    srv = live(token_delay_s=0.002, stream_interval_ms=50, reply_tokens=10_000)
    arrivals: list[tuple[float, dict]] = []
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(150, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append((time.monotonic(), json.loads(line[6:])))
    contents = [(t, ch) for t, ch in arrivals if ch["choices"] and ch["choices"][0]["delta"].get("content")]
    tokens = srv.engine.generations[0].tokens
    assert tokens == 150
    # first chunk: one token; the last chunk (finish) flushes what is left at the end
    assert contents[0][1]["choices"][0]["delta"]["content"].strip() != ""
    middle = [t for t, _ in contents[1:-1]]
    gaps = [b - a for a, b in itertools.pairwise(middle)]
    assert len(contents) <= 2 + tokens // 5  # far fewer chunks than tokens
    assert gaps and sorted(gaps)[len(gaps) // 2] >= 0.04  # median gap about the interval


def test_stream_when_engine_fails_mid_stream_then_error_chunk_then_done(live) -> None:
    srv = live(token_delay_s=0.001, fail_after_tokens=3, reply_tokens=10_000)
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(50, stream=True)) as r:
        assert r.status_code == 200
        data = data_lines(r)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["code"] == "internal_error"
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-2])
    assert text  # the tokens before the failure were delivered


def test_non_stream_when_engine_fails_then_500_openai_shape(live) -> None:
    srv = live(fail_after_tokens=1)
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat(5))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"


def test_health_when_model_loading_then_200_loading_and_a_chat_waits_for_it_then_ok_with_model(live) -> None:
    release = threading.Event()
    engine = RecordingEngine(ScriptedEngine(model_id=MODEL, variant="q8"))

    def factory() -> RecordingEngine:
        release.wait(5)
        return engine

    srv = live(engine_factory=factory)
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "loading"  # healthy at once, as Ollama is
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, srv.url + "/v1/chat/completions", json=chat(1), timeout=10)
        time.sleep(0.3)
        assert not waiting.done()  # queued for the load, not refused
        release.set()
        assert waiting.result().status_code == 200
    body = httpx.get(srv.url + "/health").json()
    assert body["status"] == "ok"
    assert body["model"] == MODEL and body["variant"] == "q8" and body["queue_depth"] == 0


def test_metrics_when_requests_served_then_counters_and_histograms(live) -> None:
    srv = live()
    httpx.post(srv.url + "/v1/chat/completions", json=chat(3))
    httpx.post(srv.url + "/v1/chat/completions", json={"messages": "bad"})
    text = httpx.get(srv.url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['simmer_requests_total{route="/v1/chat/completions",status="200"}'] == 1
    assert samples['simmer_requests_total{route="/v1/chat/completions",status="400"}'] == 1
    assert samples["simmer_generated_tokens_total"] == 3
    assert samples["simmer_prompt_tokens_total"] > 0
    assert samples["simmer_ttft_seconds_count"] == 1
    assert samples["simmer_inter_token_seconds_count"] == 2
    assert samples["simmer_queue_depth"] == 0
    assert samples["simmer_busy_seconds_total"] > 0


def test_server_when_request_leaves_sampling_out_then_settings_defaults_reach_the_engine(live) -> None:
    srv = live(temperature=0.7, top_k=20, top_p=0.9, min_p=0.1)
    assert httpx.post(srv.url + "/v1/chat/completions", json=chat(2), timeout=5).status_code == 200
    sent = {**chat(2), "temperature": 0.2, "top_k": 0}
    assert httpx.post(srv.url + "/v1/chat/completions", json=sent, timeout=5).status_code == 200
    assert srv.engine.wait_for(lambda gens: len(gens) == 2 and gens[1].finish is not None)
    first, second = (g.params.sampling for g in srv.engine.generations)
    assert (first.temperature, first.top_k, first.top_p, first.min_p) == (0.7, 20, 0.9, 0.1)
    assert (second.temperature, second.top_k, second.top_p, second.min_p) == (0.2, 0, 0.9, 0.1)


def test_worker_tokens_ahead_when_a_reply_runs_and_two_wait_then_what_is_left_of_each(live) -> None:
    """Routing's wait estimate: the running reply's max_tokens less what it generated, plus each queued
    reply's max_tokens (one without counts UNBOUNDED_REPLY_TOKENS); a client that left frees its share."""
    from server.serving.contracts import UNBOUNDED_REPLY_TOKENS

    srv = live(token_delay_s=0.02, reply_tokens=10_000)
    worker = srv.app.state.runtime.worker
    assert worker.tokens_ahead() == 0
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=chat(1000, stream=True)) as r:
        lines = r.iter_lines()
        assert srv.engine.wait_for(lambda gens: len(gens) == 1)
        for _ in range(4):
            next(lines)  # some tokens out
        running = worker.tokens_ahead()
        assert 0 < running < 1000

        def send(body: dict) -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=srv.url, timeout=3) as client:
                client.post("/v1/chat/completions", json=body)  # leaves after 3 s: the reply is endless

        queued = [
            threading.Thread(target=send, args=(b,)) for b in (chat(7), {"model": MODEL, "messages": MSG})
        ]
        for t in queued:
            t.start()
            assert wait_until(lambda n=queued.index(t) + 1: queue_depth(srv) == n)
        ahead = worker.tokens_ahead()
        assert 0 < ahead - 7 - UNBOUNDED_REPLY_TOKENS <= running  # the running reply went on meanwhile
    for t in queued:
        t.join(30)
    assert wait_until(lambda: worker.tokens_ahead() == 0)


class UnbatchableEngine(ScriptedEngine):
    """An engine whose batch decoder cannot be built (a bug of its own): the worker must answer and go on."""

    def __init__(self) -> None:
        super().__init__(model_id=MODEL)
        self.broken = True

    def batch_decoder(self, slots: int):
        if self.broken:
            self.broken = False
            raise AttributeError("a bug in building the batch decoder")
        return None


def test_worker_when_the_batch_decoder_cannot_be_built_then_that_reply_fails_and_the_next_is_served(
    live,
) -> None:
    srv = live(engine=UnbatchableEngine())
    with srv.client() as c:
        failed = c.post("/v1/chat/completions", json=chat(4), timeout=20)
        served = c.post("/v1/chat/completions", json=chat(4), timeout=20)
    assert failed.status_code == 500 and failed.json()["error"]["type"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
