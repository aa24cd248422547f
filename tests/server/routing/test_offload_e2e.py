"""The governor's new lever: on a hot or backgrounded simulated phone (sim:phone-heatwave), auto sends new
work upstream instead of making it wait, says why, and comes home when the device recovers.

The device is the real simulator heated by this process's real CPU time (the tiny model generating), as
`simmer serve` with SIMMER_THERMAL_SOURCE=sim:phone-heatwave and a large SIMMER_SIM_TIME_SCALE runs it.
"""

from __future__ import annotations

import threading
import time

import httpx

from server.governor_setup import build_gate
from server.settings import Settings
from tests.server.routing.test_upstream_e2e import CHAT

HEAT = {**CHAT, "max_tokens": 200, "ignore_eos": True, "route": "local"}


def heatwave_gate(time_scale: float, *, pace_control: bool = True):
    settings = Settings(
        thermal_source="sim:phone-heatwave",
        sim_time_scale=time_scale,
        pause_timeout_s=10,
        governor_poll_s=5,
        pace_control=pace_control,
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


def test_auto_when_device_critical_then_upstream_thermal_and_home_when_cool(local, proxy) -> None:
    """Heat the simulated phone with local work until the governor holds new work (critical): an auto
    request then answers from the upstream at once instead of waiting; once it cooled, it is local again.
    On the level machine (SIMMER_PACE_CONTROL=false): the default pace controller holds the device below
    T_throttle by pacing, and holds new work only in an emergency near T_critical, which this heater's
    paced load never reaches."""
    srv = local(governor=heatwave_gate(40.0, pace_control=False))
    stop = threading.Event()

    def heat() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while not stop.is_set():
                c.post("/v1/chat/completions", json=HEAT)

    heater = threading.Thread(target=heat, daemon=True)
    heater.start()
    try:
        with srv.client() as c:
            thermal = lambda: c.get("/v1/thermal").json()  # noqa: E731
            hot = wait_for(
                lambda: (t := thermal())["limits"]["pause_new"] and t, 60, "the device to get critical"
            )
            assert hot["level"] == "critical" and hot["cause"] == "thermal"
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=CHAT)
            waited = time.monotonic() - t0
            assert r.status_code == 200 and r.headers["x-simmer-route"] == "upstream; reason=thermal"
            assert r.json()["route"] == {"served": "upstream", "reason": "thermal"}
            assert waited < 10  # served, not held for the pause (pause_timeout_s is 10)
            stop.set()
            trace = []
            thermal = lambda: trace.append(t := c.get("/v1/thermal").json()) or t  # noqa: E731
            wait_for(
                lambda: not (t := thermal())["limits"]["pause_new"] and t["level"] != "critical",
                60,
                "cooling",
                poll_s=1.0,
                describe=lambda: [(x["temperature"]["celsius"], x["level"]) for x in trace[-120::10]],
            )
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.json()["route"] == {"served": "local", "reason": "offline_first"}
            assert c.get("/v1/thermal").json()["routing"]["requests"]["upstream"]["thermal"] >= 1
    finally:
        stop.set()
        heater.join(15)
