"""A request served upstream, or moved between the sides before its first token, is accounted exactly once:
one log line, and /metrics' token totals equal the sum of the lines (server/serving/accounting.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading

import httpx

from models.errors import ContextLengthExceeded
from models.types import FinishEvent
from server.routing.router import Router
from server.routing.upstream import UpstreamClient
from server.serving.accounting import RequestAccount
from server.serving.contracts import Job
from server.serving.events import Failed
from tests import aio
from tests.server.helpers import metric, request_lines, wait_until
from tests.server.routing.conftest import free_port
from tests.server.routing.helpers import CHAT, REQUEST, local_side, stream
from tests.server.routing.scripted import Script, ScriptedUpstream, chat_chunk

USAGE = json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": {
    "prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}})  # fmt: skip


def accounted_job(events: list, written: list, route_of=lambda: None) -> Job:
    account = RequestAccount(
        id="t", endpoint="chat", model="m", stream=True, emit=written.append, route=route_of
    )
    return Job(id="t", request=REQUEST, sink=events.append, account=account)


async def settle(router: Router) -> None:
    while router._tasks:
        await asyncio.sleep(0.01)


def test_account_when_served_upstream_then_the_relay_is_the_worker_half() -> None:
    upstream = ScriptedUpstream()
    upstream.script = Script(events=[chat_chunk("hello"), chat_chunk(" world", "stop"), USAGE, "[DONE]"])
    upstream.start()
    try:

        async def scenario() -> tuple[list, list]:
            router = Router(
                policy="upstream",
                local=local_side([]),
                device=lambda: None,
                upstream=UpstreamClient(upstream.url),
            )
            events: list = []
            written: list = []
            route = router.plan(None, None, None, truncate=False)
            j = accounted_job(events, written, lambda: f"{route.side}/{route.reason}")
            router.start(route, j)
            assert j.account is not None
            while not any(isinstance(e, FinishEvent) for e in events):
                await asyncio.sleep(0.01)
            j.account.route_done("stop", 2)  # what the route says once the reply went out
            await settle(router)
            await router.aclose()
            return events, written

        _events, written = aio.run(scenario())
    finally:
        upstream.stop()
    assert len(written) == 1
    rec = written[0]
    assert (rec.prompt_tokens, rec.completion_tokens, rec.sent_tokens, rec.outcome) == (7, 2, 2, "stop")
    assert rec.route is not None and rec.route.startswith("upstream/")


def test_account_when_local_refusal_goes_upstream_then_one_record_after_the_upstream_ends() -> None:
    """The worker refuses before Started and lets go of the job (worker_done); the upstream serves it. The
    worker's letting go is a hand-over, not the end: the record waits for the upstream's end."""
    upstream = ScriptedUpstream()
    upstream.script = Script(
        events=[chat_chunk("hello"), chat_chunk(" world", "stop"), USAGE, "[DONE]"], event_delay_s=0.2
    )
    upstream.start()
    try:

        async def scenario() -> tuple[list, list]:
            router = Router(
                policy="auto",
                local=local_side([]),
                device=lambda: None,
                upstream=UpstreamClient(upstream.url),
            )
            loop = asyncio.get_running_loop()
            events: list = []
            written: list = []
            route = router.plan(None, None, None, truncate=False)
            j = accounted_job(events, written)
            router.start(route, j)
            assert j.account is not None

            def worker_refuses() -> (
                None
            ):  # as the worker does for a reply that fails to start: sink the refusal, then let go
                j.sink(Failed(ContextLengthExceeded("too long")))
                j.worker_done()

            await loop.run_in_executor(None, worker_refuses)
            while not router._tasks:
                await asyncio.sleep(0.01)
            j.account.route_done("client_gone", 0)  # the client leaves while the upstream still answers
            snapshot = list(written)
            await settle(router)
            await router.aclose()
            return snapshot, written

        before_end, written = aio.run(scenario())
    finally:
        upstream.stop()
    assert before_end == []  # not written while the upstream still served the job
    assert len(written) == 1 and written[0].outcome == "client_gone"


def test_account_when_local_refusal_stays_then_one_record() -> None:
    """A refusal that may not go upstream (the request said local) reaches the client; the record is written
    once both the worker and the route are done."""
    upstream = ScriptedUpstream().start()
    try:

        async def scenario() -> tuple[list, list]:
            router = Router(
                policy="auto",
                local=local_side([]),
                device=lambda: None,
                upstream=UpstreamClient(upstream.url),
            )
            loop = asyncio.get_running_loop()
            events: list = []
            written: list = []
            route = router.plan(None, "local", None, truncate=False)
            j = accounted_job(events, written)
            router.start(route, j)

            def worker_refuses() -> None:
                j.sink(Failed(ContextLengthExceeded("too long")))
                j.worker_done()

            await loop.run_in_executor(None, worker_refuses)
            while not events:
                await asyncio.sleep(0.01)
            assert j.account is not None
            j.account.route_done(events[0].error.code, 0)
            await router.aclose()
            return events, written

        events, written = aio.run(scenario())
    finally:
        upstream.stop()
    assert isinstance(events[0], Failed)
    assert len(written) == 1 and written[0].outcome == "context_length_exceeded"


def test_account_when_upstream_fails_before_start_and_local_takes_it_then_the_local_worker_ends_it() -> None:
    async def scenario() -> tuple[list, list, list]:
        submitted: list = []
        router = Router(
            policy="auto",
            local=local_side(submitted),
            device=lambda: None,
            upstream=UpstreamClient(f"http://127.0.0.1:{free_port()}/v1"),  # nothing listens
        )
        events: list = []
        written: list = []
        route = router.plan(None, "upstream", None, truncate=False)
        route.fallback = True  # as under SIMMER_ROUTE=upstream: a failed start may be served here
        j = accounted_job(events, written)
        router.start(route, j)
        await settle(router)
        assert j.account is not None
        j.account.route_done("stop", 0)
        snapshot = list(written)
        j.worker_done()  # the local worker, once it is done with the job
        await router.aclose()
        return submitted, snapshot, written

    submitted, before_local, written = aio.run(scenario())
    assert len(submitted) == 1  # the local side took it over
    assert before_local == []  # the upstream side did not end the worker half
    assert len(written) == 1


def test_logs_when_served_upstream_then_metrics_equal_sum_of_lines(local, caplog) -> None:
    """Complete (plain and streamed) and cut streams served by a real upstream, and local ones beside them:
    one line each, and the token counters are the sums of the lines."""
    srv = local()
    caplog.set_level(logging.INFO)
    long = {**CHAT, "max_tokens": 150, "ignore_eos": True}
    with srv.client() as c:
        assert c.post("/v1/chat/completions", json={**CHAT, "route": "upstream"}).status_code == 200
        assert c.post("/v1/chat/completions", json={**CHAT, "route": "local"}).status_code == 200
    r, _, done = stream(srv, "/v1/chat/completions", {**CHAT, "route": "upstream"})
    assert r.status_code == 200 and done
    got: list[str] = []

    def cut() -> None:  # read three chunks of an upstream stream, then hang up
        with contextlib.suppress(httpx.HTTPError), srv.client() as c:
            body = {**long, "route": "upstream", "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        got.append(line)
                    if len(got) >= 3:
                        return

    t = threading.Thread(target=cut)
    t.start()
    t.join(30)
    assert len(got) >= 3
    assert wait_until(lambda: len(request_lines(caplog)) == 4, timeout=15)
    lines = request_lines(caplog)
    routes = sorted(line["route"].split("/")[0] for line in lines)
    assert routes == ["local", "upstream", "upstream", "upstream"]
    assert sorted(line["outcome"] for line in lines) == ["client_gone", "length", "length", "length"]
    for line in lines:
        assert line["prompt_tokens"] > 0 or line["outcome"] == "client_gone"
        assert line["completion_tokens"] > 0
    assert metric(srv, "simmer_prompt_tokens_total") == sum(line["prompt_tokens"] for line in lines)
    assert metric(srv, "simmer_generated_tokens_total") == sum(line["completion_tokens"] for line in lines)
