"""The route step on its own (an event loop, a recording sink, a fake local side): what the HTTP tests
cannot time, such as a client that leaves before the upstream task ever ran, or a shutdown mid-relay."""

from __future__ import annotations

import asyncio
import json

from models.types import CancelToken, GenerationParams
from server.routing.breaker import Breaker
from server.routing.router import LocalSide, Router
from server.routing.upstream import UpstreamClient
from server.schemas import ChatCompletionRequest
from server.worker import Failed, Job
from tests.server.routing.scripted import Script, ScriptedUpstream, chat_chunk

BODY = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def local_side(submitted: list) -> LocalSide:
    return LocalSide(
        served_ids=lambda: {"m"},
        model_id=lambda: "m",
        state=lambda: "ready",
        queue_full=lambda: False,
        submit=submitted.append,
    )


def job(events: list) -> Job:
    return Job(
        id="t", kind="chat", payload=BODY.message_dicts(), params=GenerationParams(), sink=events.append
    )


def test_router_when_client_leaves_before_upstream_task_runs_then_probe_freed() -> None:
    clock = Clock()
    breaker = Breaker(1, 10.0, clock=clock)
    breaker.failure("connect")
    clock.now = 10.0  # half-open: the next request is the probe

    async def scenario() -> str:
        router = Router(
            policy="upstream",
            local=local_side([]),
            device=lambda: None,
            upstream=UpstreamClient("http://127.0.0.1:9/v1"),
            breaker=breaker,
        )
        events: list = []
        j = job(events)
        route = router.plan(None, None, None, truncate=False)
        router.start(route, j, "chat", BODY, j.payload)
        assert breaker.state == "open"  # the probe is out
        j.cancel.cancel()  # the client hangs up before the task ever ran
        for _ in range(5):
            await asyncio.sleep(0)
        await router.aclose()
        return breaker.state

    assert asyncio.run(scenario()) == "half_open"  # not stuck "open" with a probe that will never report


def test_router_when_shutdown_mid_relay_then_job_told_shutting_down() -> None:
    upstream = ScriptedUpstream()
    upstream.script = Script(events=[chat_chunk("a"), chat_chunk("b"), "[DONE]"], event_delay_s=5.0)
    upstream.start()
    try:

        async def scenario() -> list:
            router = Router(
                policy="upstream",
                local=local_side([]),
                device=lambda: None,
                upstream=UpstreamClient(upstream.url),
            )
            events: list = []
            j = job(events)
            router.start(router.plan(None, None, None, truncate=False), j, "chat", BODY, j.payload)
            for _ in range(100):
                if upstream.received:
                    break
                await asyncio.sleep(0.02)
            await router.aclose()
            return events

        events = asyncio.run(scenario())
    finally:
        upstream.stop()
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].error.code == "server_shutting_down"


def test_router_when_local_refuses_before_start_then_auto_goes_upstream() -> None:
    """The worker says the prompt is too long (before Started): an auto request is decided again and goes
    upstream with reason context; a request that forbade upstream gets the refusal."""
    from models.errors import ContextLengthExceeded

    upstream = ScriptedUpstream().start()
    try:

        async def scenario(body_route):
            submitted: list = []
            router = Router(
                policy="auto",
                local=local_side(submitted),
                device=lambda: None,
                upstream=UpstreamClient(upstream.url),
            )
            loop = asyncio.get_running_loop()
            events: list = []
            got = asyncio.Event()

            def sink(item):
                events.append(item)
                got.set()

            j = Job(
                id="t",
                kind="chat",
                payload=BODY.message_dicts(),
                params=GenerationParams(),
                sink=sink,
                cancel=CancelToken(),
            )
            route = router.plan(None, body_route, None, truncate=False)
            router.start(route, j, "chat", BODY, j.payload)
            assert submitted == [j] and route.side == "local"
            # the worker thread refuses it before Started
            await loop.run_in_executor(None, j.sink, Failed(ContextLengthExceeded("too long")))
            await asyncio.wait_for(got.wait(), 10)
            while route.side == "upstream" and not any(type(e).__name__ == "FinishEvent" for e in events):
                await asyncio.sleep(0.02)
            await router.aclose()
            return route, events

        route, events = asyncio.run(scenario(None))
        assert (route.side, route.reason) == ("upstream", "context")
        assert "".join(getattr(e, "text", "") for e in events) == "hello world"
        route, events = asyncio.run(scenario("local"))
        assert (route.side, route.reason) == ("local", "request")
        assert isinstance(events[0], Failed) and events[0].error.code == "context_length_exceeded"
        assert json.loads(json.dumps(upstream.received[0][0]))["messages"] == [
            {"role": "user", "content": "hi"}
        ]
        assert len(upstream.received) == 1
    finally:
        upstream.stop()
