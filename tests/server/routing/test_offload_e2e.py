"""The governor's new lever: on a hot or backgrounded simulated phone (sim:phone-heatwave), auto sends new
work upstream instead of making it wait, says why, and comes home when the device recovers.

The device is the real simulator heated by this process's real CPU time (the tiny model generating), as
`simmer serve` with SIMMER_THERMAL_SOURCE=sim:phone-heatwave and a large SIMMER_SIM_TIME_SCALE runs it.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx

from governor.limits import Rung, rungs_from_manifest
from server.serving.cost_meter import CostMeter
from server.serving.governor_gate import GovernorGate
from server.serving.governor_setup import build_gate, build_governor
from server.settings import Settings
from tests.server.fakes import RecordingEngine, ScriptedEngine
from tests.server.helpers import metric, request_lines, wait_until
from tests.server.routing.conftest import MODEL
from tests.server.routing.helpers import CHAT

HEAT = {**CHAT, "max_tokens": 200, "ignore_eos": True, "route": "local"}


def heatwave_gate(time_scale: float):
    settings = Settings(
        thermal_source="sim:phone-heatwave", sim_time_scale=time_scale, pause_timeout_s=10, governor_poll_s=5
    )
    return build_gate(settings)


def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.02, describe=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {describe()}"
        time.sleep(poll_s)


def test_auto_when_backgrounded_then_upstream_and_home_in_foreground(local, proxy) -> None:
    srv = local(governor=heatwave_gate(1.0))  # real time: no heating within the test
    with srv.client() as c:
        assert c.post("/v1/chat/completions", json=CHAT).json()["route"]["served"] == "local"
        assert c.post("/v1/lifecycle", json={"state": "background"}).json()["limits"]["pause_new"]
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers["x-simmer-route"] == "upstream; reason=background"
        assert r.json()["choices"][0]["message"]["content"]
        routing = c.get("/v1/thermal").json()["routing"]
        assert routing["requests"]["upstream"] == {"background": 1}
        assert routing["policy"] == "auto" and routing["upstream"]["configured"]
        assert routing["breaker"]["state"] == "closed"
        c.post("/v1/lifecycle", json={"state": "foreground"})
        assert c.post("/v1/chat/completions", json=CHAT).json()["route"] == {
            "served": "local",
            "reason": "offline_first",
        }
    assert proxy.connections == 1


def paced_heatwave_gate(model_dir, time_scale: float):
    """The pacing governor (the default) on sim:phone-heatwave, with the tiny model's measured rung, so the
    pace it allows is known in tokens/s (its budget over the manifest's CPU seconds per token). The meter
    publishes nothing here: on a shared machine a measured cost could double the cost, and with it the
    budget each tok/s threshold below stands for; the thresholds are in cores, through the manifest's cost."""
    settings = Settings(
        thermal_source="sim:phone-heatwave", sim_time_scale=time_scale, pause_timeout_s=10, governor_poll_s=5
    )
    manifest = json.loads((model_dir / "manifest.json").read_text())
    rung = next(Rung(*r) for r in rungs_from_manifest(MODEL, manifest["variants"]) if r[1] == "q4")
    gate = GovernorGate(
        build_governor(settings, ladder=[rung]),
        pause_timeout_s=settings.pause_timeout_s,
        meter=CostMeter(publish_every=10**9),
    )
    return gate, rung.cpu_s_per_token


def test_auto_when_heat_paces_the_device_then_upstream_thermal_and_home_when_cool(
    local, proxy, tiny_model_dir
) -> None:
    """The default governor slows a hot device instead of pausing it. Heat the simulated phone with local
    work until the pace it allows falls under SIMMER_ROUTE_MIN_LOCAL_TOK_S: an auto request then answers
    from the upstream (reason thermal) while the device stays paced, never paused; once it cooled past the
    hysteresis band, new work is local again."""
    gate, cost = paced_heatwave_gate(tiny_model_dir, 40.0)
    # The pace 0.3 core buys: the phone in a heatwave holds ~0.15 core hot, ~0.7 core idle (40.5 C: it never
    # cools further in 38 C air), 1.7 cores cold; home at 1.5 x 0.3 = 0.45 core.
    floor = 0.3 / cost
    srv = local(governor=gate, route_min_local_tok_s=floor, route_max_local_wait_s=0)
    stop = threading.Event()

    def heat() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while not stop.is_set():
                c.post("/v1/chat/completions", json=HEAT)

    heater = threading.Thread(target=heat, daemon=True)
    with srv.client() as c:
        trace: list[dict] = []

        def thermal() -> dict:
            trace.append(t := c.get("/v1/thermal").json())
            return t

        def describe() -> list:
            return [
                (x["temperature"]["celsius"], x["level"], x["routing"]["pace"]["local_tok_s"])
                for x in trace[-60::6]
            ]

        def pace(t: dict) -> float | None:
            return t["routing"]["pace"]["local_tok_s"]

        def wait_cool(what: str) -> None:
            wait_for(
                lambda: (p := pace(thermal())) is None or p >= 1.5 * floor,
                60,
                what,
                poll_s=0.5,
                describe=describe,
            )

        # The device starts cool. In a long pytest process the server's startup (session build, the heap
        # handed back) costs more CPU, and at 40x the simulated phone can read warm at first: let it cool.
        wait_cool("the device to start cool")
        assert c.post("/v1/chat/completions", json=CHAT).json()["route"]["reason"] == "offline_first"
        heater.start()
        try:
            hot = wait_for(
                lambda: (t := thermal()) and (p := pace(t)) is not None and p < floor and t,
                60,
                "the pace to fall under the floor",
                describe=describe,
            )
            assert hot["cause"] == "thermal" and not hot["limits"]["pause_new"] and hot["level"] != "critical"
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.headers["x-simmer-route"] == "upstream; reason=thermal"
            assert r.json()["choices"][0]["message"]["content"]
            assert c.get("/v1/thermal").json()["routing"]["pace"]["slow"] is True
        finally:
            stop.set()
            heater.join(30)
        wait_cool("cooling past the band")
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.json()["route"] == {"served": "local", "reason": "offline_first"}, describe()
        routing = c.get("/v1/thermal").json()["routing"]
        assert routing["pace"]["slow"] is False and routing["requests"]["upstream"] == {"thermal": 1}
        assert gate.pauses == 0  # paced all along, never paused


def test_auto_when_paused_while_queued_locally_then_moves_upstream_at_once_accounted_once(
    local, proxy, caplog
) -> None:
    """An auto request waiting in the local queue when the device pauses new work goes upstream at once
    (it used to wait out the pause). The reply running locally stays (paused); one that
    forbade the upstream waits in the queue. Each request is one log line, its tokens counted once."""
    caplog.set_level(logging.INFO)
    engine = RecordingEngine(ScriptedEngine(model_id=MODEL, token_delay_s=0.05, reply_tokens=10_000))
    srv = local(engine=engine, governor=heatwave_gate(1.0))  # real time: no heating within the test
    results: dict[str, tuple[httpx.Response, float]] = {}

    def post(name: str, body: dict) -> None:
        t0 = time.monotonic()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            results[name] = (c.post("/v1/chat/completions", json=body), time.monotonic() - t0)

    with srv.client() as c:
        running = threading.Thread(
            target=post, args=("running", {**CHAT, "max_tokens": 100, "route": "local"})
        )
        running.start()
        assert engine.wait_for(lambda gens: len(gens) == 1)
        queued = [
            threading.Thread(target=post, args=("auto", {**CHAT, "max_tokens": 5})),
            threading.Thread(target=post, args=("pinned", {**CHAT, "max_tokens": 5, "route": "local"})),
        ]
        for i, t in enumerate(queued):
            t.start()
            wait_for(lambda i=i: c.get("/health").json()["queue_depth"] == i + 1, 10, "the queue")
        assert c.post("/v1/lifecycle", json={"state": "background"}).json()["limits"]["pause_new"]
        queued[0].join(8)
        assert "auto" in results, "the auto request is still held in the local queue"
        r, waited = results["auto"]
        assert r.status_code == 200 and r.headers["x-simmer-route"] == "upstream; reason=background"
        assert r.json()["route"] == {"served": "upstream", "reason": "background"}
        assert r.json()["choices"][0]["message"]["content"]
        assert waited < 8  # not held: the pause lasts until foreground (pause_timeout_s is 10)
        assert c.get("/health").json()["queue_depth"] == 1  # the pinned one still waits here
        c.post("/v1/lifecycle", json={"state": "foreground"})
    running.join(30)
    queued[1].join(30)
    assert results["running"][0].json()["route"]["served"] == "local"
    assert results["pinned"][0].json()["route"] == {"served": "local", "reason": "request"}
    assert len(engine.generations) == 2  # the moved request never ran here
    assert wait_until(lambda: len(request_lines(caplog)) == 3, timeout=15)
    lines = request_lines(caplog)
    assert sorted(line["route"] for line in lines) == [
        "local/request",
        "local/request",
        "upstream/background",
    ]
    assert metric(srv, "simmer_generated_tokens_total") == sum(line["completion_tokens"] for line in lines)
