"""The route step on its own (an event loop, a recording sink, a fake local side): what the HTTP tests
cannot time, such as a client that leaves before the upstream task ever ran, or a shutdown mid-relay."""

from __future__ import annotations

import asyncio
import json

from models.types import CancelToken
from server.routing.breaker import Breaker
from server.routing.router import Router
from server.routing.sides import LocalSide
from server.routing.upstream import UpstreamClient
from server.serving.contracts import Job
from server.serving.events import Failed
from tests import aio
from tests.server.routing.helpers import REQUEST, local_side
from tests.server.routing.scripted import Script, ScriptedUpstream, chat_chunk


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def job(events: list) -> Job:
    return Job(id="t", request=REQUEST, sink=events.append)


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
        router.start(route, j)
        assert breaker.state == "open"  # the probe is out
        j.cancel.cancel()  # the client hangs up before the task ever ran
        for _ in range(5):
            await asyncio.sleep(0)
        await router.aclose()
        return breaker.state

    assert aio.run(scenario()) == "half_open"  # not stuck "open" with a probe that will never report


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
            router.start(router.plan(None, None, None, truncate=False), j)
            for _ in range(100):
                if upstream.received:
                    break
                await asyncio.sleep(0.02)
            await router.aclose()
            return events

        events = aio.run(scenario())
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

            j = Job(id="t", request=REQUEST, sink=sink, cancel=CancelToken())
            route = router.plan(None, body_route, None, truncate=False)
            router.start(route, j)
            assert submitted == [j] and route.side == "local"
            # the worker thread refuses it before Started
            await loop.run_in_executor(None, j.sink, Failed(ContextLengthExceeded("too long")))
            await asyncio.wait_for(got.wait(), 10)
            while route.side == "upstream" and not any(type(e).__name__ == "FinishEvent" for e in events):
                await asyncio.sleep(0.02)
            await router.aclose()
            return route, events

        route, events = aio.run(scenario(None))
        assert (route.side, route.reason) == ("upstream", "context")
        assert "".join(getattr(e, "text", "") for e in events) == "hello world"
        route, events = aio.run(scenario("local"))
        assert (route.side, route.reason) == ("local", "request")
        assert isinstance(events[0], Failed) and events[0].error.code == "context_length_exceeded"
        assert json.loads(json.dumps(upstream.received[0][0]))["messages"] == [
            {"role": "user", "content": "hi"}
        ]
        assert len(upstream.received) == 1
    finally:
        upstream.stop()


def test_router_when_heat_slows_the_pace_then_auto_plans_upstream_and_home_past_the_band() -> None:
    """The router keeps pace_slow()'s state from one request to the next: out under the floor, home only at
    HOME_FACTOR x the floor, and every plan sees the work ahead of it in the worker."""
    from server.routing.decision import DeviceState

    pace = {"tok_s": 20.0}
    ahead = {"n": 0}
    router = Router(
        policy="auto",
        local=LocalSide(
            served_ids=lambda: {"m"},
            default_model=lambda: "m",
            state=lambda: "ready",
            queue_full=lambda: False,
            submit=lambda j: None,
            tokens_ahead=lambda: ahead["n"],
        ),
        device=lambda: DeviceState("serious", cause="thermal", pace_tok_s=pace["tok_s"]),
        upstream=UpstreamClient("http://127.0.0.1:9/v1"),  # planning opens no connection
        min_local_tok_s=5.0,
        max_local_wait_s=10.0,
    )

    def plan(tok_s: float, tokens_ahead: int = 0) -> tuple[str, str]:
        pace["tok_s"], ahead["n"] = tok_s, tokens_ahead
        route = router.plan(None, None, None, truncate=False)
        return route.side, route.reason

    assert plan(20.0) == ("local", "offline_first")
    assert plan(20.0, tokens_ahead=300) == ("upstream", "thermal")  # 15 s of work ahead at 20 tok/s
    assert plan(20.0, tokens_ahead=100) == ("local", "offline_first")  # 5 s: within the bound
    assert plan(4.0) == ("upstream", "thermal")  # under the floor
    assert router.state()["pace"]["slow"] is True
    assert plan(6.0) == ("upstream", "thermal")  # cooled a little: still inside the band
    assert plan(7.6) == ("local", "offline_first")  # 1.5 x 5: home
    assert plan(6.0) == ("local", "offline_first")  # and it stays home inside the band
    assert router.state()["pace"] == {
        "local_tok_s": 6.0,
        "min_local_tok_s": 5.0,
        "slow": False,
        "max_local_wait_s": 10.0,
        "local_tokens_ahead": 0,
    }
    assert plan(6.0, tokens_ahead=100) == ("upstream", "thermal")  # 16.7 s ahead at 6 tok/s
    ahead["n"] = 100
    assert router.plan(None, "local", None, truncate=False).side == "local"  # a request may forbid it
    aio.run(router.aclose())


def test_router_when_policy_local_then_the_pace_floor_never_trips() -> None:
    from server.routing.decision import DeviceState

    router = Router(
        policy="local",
        local=local_side([]),
        device=lambda: DeviceState("serious", cause="thermal", pace_tok_s=0.5),
        upstream=UpstreamClient("http://127.0.0.1:9/v1"),
        min_local_tok_s=5.0,
    )
    assert (router.plan(None, None, None, truncate=False).side, router.slow) == ("local", False)
    aio.run(router.aclose())


def test_device_view_when_heat_binds_the_budget_then_the_pace_reaches_routing() -> None:
    """The read-only seam: the pace is the governor's tokens_per_second, only while the cause is thermal and
    its CPU budget binds (enforced); otherwise None."""
    from types import SimpleNamespace

    from governor.limits import Limits
    from server.routing.sides import device_view

    def view(cause="thermal", budget=0.2, tok_s=6.5, enforced=True, level="serious"):
        snap = SimpleNamespace(
            level=level,
            lifecycle="foreground",
            cause=cause,
            device_killed=False,
            enforced=enforced,
            limits=Limits(cpu_budget_cores=budget, tokens_per_second=tok_s),
        )
        return device_view(SimpleNamespace(snapshot=lambda: snap))()

    assert view().pace_tok_s == 6.5
    assert view(budget=None, tok_s=None).pace_tok_s is None  # every core: heat does not bind
    assert view(tok_s=None).pace_tok_s is None  # no cost per token known
    assert view(cause="memory").pace_tok_s is None  # the table's memory pace is not heat
    assert view(cause="none", level="nominal").pace_tok_s is None
    assert view(enforced=False).pace_tok_s is None  # observe only: nothing is paced
    assert device_view(None)() is None


def test_router_when_new_work_is_held_then_queued_auto_jobs_move_and_the_others_stay() -> None:
    """device_changed() on a pause: an auto job still in the local queue goes upstream (reason from the
    device); one the worker already took, one that forbade the upstream, and any job while the breaker is
    open or the device is not paused stay queued."""
    from server.routing.decision import DeviceState

    upstream = ScriptedUpstream().start()
    try:

        async def scenario(*, paused: bool, breaker_open: bool, body_route, in_queue: bool):
            queue: list = []
            device = {"now": DeviceState("nominal")}
            breaker = Breaker(1, 60.0)
            router = Router(
                policy="auto",
                local=LocalSide(
                    served_ids=lambda: {"m"},
                    default_model=lambda: "m",
                    state=lambda: "ready",
                    queue_full=lambda: False,
                    submit=queue.append,
                    take_back=lambda j: j in queue and (queue.remove(j) or True),
                ),
                device=lambda: device["now"],
                upstream=UpstreamClient(upstream.url),
                breaker=breaker,
            )
            events: list = []
            done = asyncio.Event()

            def sink(item):
                events.append(item)
                if type(item).__name__ == "FinishEvent":
                    done.set()

            j = Job(id="t", request=REQUEST, sink=sink)
            route = router.plan(None, body_route, None, truncate=False)
            router.start(route, j)
            assert route.side == "local" and queue == [j]
            if not in_queue:
                queue.clear()  # the worker took it (not Started yet)
            if breaker_open:
                breaker.failure("connect")
            if paused:
                device["now"] = DeviceState("critical", paused=True, cause="thermal")
            await asyncio.get_running_loop().run_in_executor(None, router.device_changed)
            await asyncio.sleep(0.05)
            if route.side == "upstream":
                await asyncio.wait_for(done.wait(), 10)
            await router.aclose()
            return route, events, queue

        route, events, queue = aio.run(
            scenario(paused=True, breaker_open=False, body_route=None, in_queue=True)
        )
        assert (route.side, route.reason, queue) == ("upstream", "thermal", [])
        assert "".join(getattr(e, "text", "") for e in events) == "hello world"
        for kwargs in (
            {"paused": False, "breaker_open": False, "body_route": None, "in_queue": True},
            {"paused": True, "breaker_open": True, "body_route": None, "in_queue": True},
            {"paused": True, "breaker_open": False, "body_route": "local", "in_queue": True},
        ):
            route, events, queue = aio.run(scenario(**kwargs))
            assert (route.side, len(queue), events) == ("local", 1, []), kwargs
        route, events, _ = aio.run(scenario(paused=True, breaker_open=False, body_route=None, in_queue=False))
        assert (route.side, events) == ("local", [])
        assert len(upstream.received) == 1
    finally:
        upstream.stop()
