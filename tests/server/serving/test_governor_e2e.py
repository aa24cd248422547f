"""The governor wired into a live server: pauses, resumes, variant switches, lifecycle, 503s, /v1/thermal.

Heat comes from the real simulator (`phone-heatwave` at time_scale 100) driven by a scripted CPU load the
test switches on and off, or from a scripted sensor; both plug in through the governor's ThermalSource seam.
The tiny real model runs the replies; a reply is compared token for token with the same greedy request run
on the engine alone.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from governor.governor import Governor
from governor.limits import DEFAULT_TABLE, LevelLimits, Rung
from governor.policy import PolicyConfig
from governor.sensors import SimulatedThermalSource, TemperatureReading
from governor.thermal_sim import ThermalSimulator, get_profile
from models.runtime.engine import load_engine
from models.types import GenerationParams, SamplingParams
from server.serving.governor_gate import GovernorGate
from server.serving.governor_setup import build_gate
from tests.fakes import ScriptedCPU
from tests.server.conftest import MODEL
from tests.server.fakes import RecordingEngine

PROMPT = [{"role": "user", "content": "the cat sat on"}]
REPLY_TOKENS = 120
PACE = 150.0  # tokens/s: long enough a reply (~0.8 s) for the test to heat or background the device mid-way
MiB = 2**20

# The default table, paced at every level so the tiny model (thousands of tokens/s) streams for a while.
PACED_TABLE = {
    level: LevelLimits(**{**row.__dict__, "tokens_per_second": PACE, "cpu_budget_cores": None})
    for level, row in DEFAULT_TABLE.items()
}


class ScriptedSensor:
    """A thermal sensor (the ThermalSource seam) whose temperature the test sets."""

    source = "psutil"
    simulator = None

    def __init__(self, celsius: float) -> None:
        self.celsius = celsius

    def read(self) -> TemperatureReading:
        return TemperatureReading(self.celsius, self.source, "scripted", 43.0, 48.0)


def gate_for(thermal, *, ladder=(), pause_timeout_s: float = 10.0, **config) -> GovernorGate:
    governor = Governor(
        thermal=thermal,
        config=PolicyConfig(**config),
        usable_cpus=1,  # one thread at every level: thread count changes no greedy token
        table=PACED_TABLE,
        ladder=ladder,
        poll_s=0.02 if thermal.simulator is None else 1.0,
    )
    return GovernorGate(governor, pause_timeout_s=pause_timeout_s)


@pytest.fixture
def recording_f32_engine(tiny_model_dir):
    return RecordingEngine(load_engine(tiny_model_dir, variant="f32", threads=1, context_length=256))


def reference_text(model_dir: Path, variant: str = "f32") -> str:
    """The same greedy request, on the engine alone: no server, no governor."""
    engine = load_engine(model_dir, variant=variant, threads=1, context_length=256)
    params = GenerationParams(SamplingParams(temperature=0), max_tokens=REPLY_TOKENS, ignore_eos=True)
    text = ""
    for event in engine.generate(engine.chat_prompt(PROMPT), params):
        text += event.text
    return text


@dataclass
class StreamLog:
    text: str = ""
    fingerprints: list[str] = field(default_factory=list)
    governor: list[tuple[int, dict]] = field(default_factory=list)  # (characters streamed before, state)
    usage: dict | None = None
    done: bool = False


def stream_chat(srv, on_first_token=None, on_governor=None) -> StreamLog:
    """Stream the reference request with governor events; callbacks run on this thread as events arrive."""
    body = {
        "messages": PROMPT,
        "temperature": 0,
        "max_tokens": REPLY_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "governor_events": True,
    }
    out = StreamLog()
    event = None
    with (
        httpx.Client(base_url=srv.url, timeout=20) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
                continue
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if event == "governor":
                state = json.loads(data)
                out.governor.append((len(out.text), state))
                if on_governor:
                    on_governor(state)
            elif data == "[DONE]":
                out.done = True
            else:
                chunk = json.loads(data)
                out.fingerprints.append(chunk.get("system_fingerprint"))
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content") or ""
                    if piece and not out.text and on_first_token:
                        out.text += piece
                        on_first_token()
                        continue
                    out.text += piece
            event = None
    return out


def paused(state: dict) -> bool:
    return state["limits"]["pause_running"]


# -- a running stream pauses and resumes -------------------------------------------------------------------
def test_stream_when_device_overheats_then_paused_resumed_and_no_token_lost_or_repeated(
    live, recording_f32_engine, tiny_model_dir
):
    cpu = ScriptedCPU()
    sim = ThermalSimulator(get_profile("phone-heatwave"), cpu_time_fn=cpu, time_scale=100, max_cores=2)
    gate = gate_for(SimulatedThermalSource(sim))
    srv = live(engine=recording_f32_engine, governor=gate, model=recording_f32_engine.model_id)

    def heat() -> None:
        cpu.set(2.0)  # two busy cores: the forecast crosses T_throttle within a few polls

    def cool_when_paused(state: dict) -> None:
        if paused(state):
            cpu.set(0.0)  # paused: the device idles and cools

    log = stream_chat(srv, on_first_token=heat, on_governor=cool_when_paused)

    pauses = [i for i, (_, s) in enumerate(log.governor) if paused(s)]
    assert pauses, f"no pause event in {[s['level'] for _, s in log.governor]}"
    resumes = [i for i, (_, s) in enumerate(log.governor) if i > pauses[0] and not paused(s)]
    assert resumes, "the stream was paused but never resumed"
    assert log.governor[pauses[0]][1]["level"] == "critical"
    assert log.governor[pauses[0]][1]["temperature"]["source"] == "simulated"
    # the reply went on after the resume, and it is exactly the ungoverned greedy reply
    assert log.governor[resumes[0]][0] < len(log.text)
    assert log.done
    assert log.usage["completion_tokens"] == REPLY_TOKENS
    assert log.text == reference_text(tiny_model_dir)
    assert gate.pauses >= 1
    assert gate.paused_seconds > 0


def test_lifecycle_when_background_mid_stream_then_paused_until_foreground(
    live, recording_f32_engine, tiny_model_dir
):
    gate = gate_for(ScriptedSensor(30.0))
    srv = live(engine=recording_f32_engine, governor=gate, model=recording_f32_engine.model_id)
    control = httpx.Client(base_url=srv.url, timeout=10)
    resumed_at: list[float] = []

    def background() -> None:
        r = control.post("/v1/lifecycle", json={"state": "background"})
        assert r.status_code == 200
        assert r.json()["lifecycle"] == "background"
        assert r.json()["level"] == "critical"

    def foreground_later(state: dict) -> None:
        if paused(state) and not resumed_at:
            # Held for a while: nothing may be generated meanwhile, then the app comes back.
            time.sleep(0.3)
            resumed_at.append(time.monotonic())
            assert control.post("/v1/lifecycle", json={"state": "foreground"}).json()["level"] == "nominal"

    try:
        log = stream_chat(srv, on_first_token=background, on_governor=foreground_later)
    finally:
        control.close()
    assert resumed_at, "the stream never reported the pause"
    assert log.text == reference_text(tiny_model_dir)
    assert log.usage["completion_tokens"] == REPLY_TOKENS
    assert gate.paused_seconds >= 0.25  # the worker really waited through the background period


# -- a variant switch mid-reply ----------------------------------------------------------------------------
def test_stream_when_level_serious_mid_reply_then_switches_to_cheaper_variant_and_finishes(
    live, recording_f32_engine, caplog
):
    caplog.set_level("INFO", logger="simmer.server")
    sensor = ScriptedSensor(30.0)
    model_id = recording_f32_engine.model_id
    ladder = [Rung(model_id, "f32", 2e-4, 1.0, 400_000), Rung(model_id, "q4-a8", 1e-4, 0.9, 100_000)]
    # forecast_s=0: the step from 30 to 42 C is a level, not a trend heading to critical
    gate = gate_for(sensor, ladder=ladder, forecast_s=0.0)
    srv = live(engine=recording_f32_engine, governor=gate, model=model_id)

    def warm() -> None:
        sensor.celsius = 42.0  # headroom 0.97: serious, whose rung is one step cheaper

    log = stream_chat(srv, on_first_token=warm)
    assert log.fingerprints[0] == "simmer-f32"
    assert log.fingerprints[-1] == "simmer-q4-a8"
    assert recording_f32_engine.variant == "q4-a8"
    assert log.usage["completion_tokens"] == REPLY_TOKENS  # the reply went on after the re-prefill
    assert any("mid-reply" in r.message and "variant=q4-a8" in r.message for r in caplog.records)
    assert [s["level"] for _, s in log.governor][-1] == "serious"


# -- new work during a pause ---------------------------------------------------------------------------------
def test_request_when_paused_longer_than_pause_timeout_then_503_with_retry_after(live):
    gate = gate_for(ScriptedSensor(30.0), pause_timeout_s=0.3)
    srv = live(governor=gate)
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 3}
    with srv.client() as c:
        assert c.post("/v1/lifecycle", json={"state": "background"}).status_code == 200
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json=body)
        waited = time.monotonic() - t0
        assert r.status_code == 503
        assert r.headers["Retry-After"]
        assert r.json()["error"]["code"] == "device_paused"
        assert r.json()["error"]["type"] == "server_error"
        assert waited >= 0.25  # it waited for a resume before giving up
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 503
        assert c.post("/v1/lifecycle", json={"state": "foreground"}).status_code == 200
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 3


def test_request_when_queued_during_pause_then_served_after_resume(live):
    gate = gate_for(ScriptedSensor(30.0), pause_timeout_s=10)
    srv = live(governor=gate)
    with srv.client() as c:
        c.post("/v1/lifecycle", json={"state": "background"})
        threading.Timer(
            0.3, lambda: httpx.post(srv.url + "/v1/lifecycle", json={"state": "foreground"})
        ).start()
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": PROMPT, "max_tokens": 3})
        assert r.status_code == 200
        assert time.monotonic() - t0 >= 0.25


# -- the endpoints -------------------------------------------------------------------------------------------
def test_thermal_when_sim_source_then_simulated_temperature_in_thermal_health_and_metrics(live, tmp_path):
    from tests.server.conftest import make_settings

    # time_scale 1 here: this test reads a steady state; the real process CPU heats the device
    overrides = {"thermal_source": "sim:phone-heatwave", "sim_time_scale": 1.0}
    srv = live(governor=build_gate(make_settings(tmp_path, **overrides)), **overrides)
    with srv.client() as c:
        body = c.get("/v1/thermal").json()
        assert body["temperature"]["source"] == "simulated"
        assert body["temperature"]["sensor"] == "sim:phone-heatwave"
        assert body["temperature"]["throttle_c"] == 43
        # 0.1 C below T_throttle once the simulator's fine steps show, up to 0.6 C while the only changes
        # seen are the start's fast ones (a slow machine's model load heats it 0.3 C a poll)
        assert 42.4 <= body["temperature"]["pace_setpoint_c"] <= 42.9
        assert 37.9 <= body["temperature"]["celsius"] < 43
        assert body["level"] == "fair"  # 38 C ambient is already headroom 0.83
        assert body["lifecycle"] == "foreground"
        assert body["variant"] == "q4" and body["threads"] == 1
        assert {"limits", "memory", "battery", "headroom", "forecast", "transitions"} <= body.keys()
        assert c.get("/health").json()["governor"]["level"] == "fair"
        metrics = c.get("/metrics").text
        assert 'simmer_temperature_celsius{sensor="sim:phone-heatwave",source="simulated"}' in metrics
        assert "simmer_governor_level 1.0" in metrics
        assert 'simmer_variant{variant="q4"} 1.0' in metrics
        assert "simmer_governor_pauses_total 0.0" in metrics


def test_metrics_when_the_meter_measured_batches_then_cost_per_token_of_each_batch_size(live):
    gate = gate_for(ScriptedSensor(30.0))
    for _ in range(4):  # what the gate's meter heard: passes of one reply and passes of four
        gate.meter.step("q4-a8", 2, False, 0.020, 0.010, model_id="m", tokens=1)
        gate.meter.step("q4-a8", 2, False, 0.040, 0.016, model_id="m", tokens=4)
    srv = live(governor=gate)
    with srv.client() as c:
        metrics = c.get("/metrics").text
    labels = 'model="m",rows="{}",spinning="false",threads="2",variant="q4-a8"'
    assert f"simmer_cost_cpu_seconds_per_token{{{labels.format(1)}}} 0.02" in metrics
    assert f"simmer_cost_cpu_seconds_per_token{{{labels.format(4)}}} 0.01" in metrics
    assert f"simmer_cost_tokens_per_second{{{labels.format(4)}}} 250.0" in metrics


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_thermal_when_cgroup_fixture_then_reports_its_memory_limit(live, tmp_path):
    from tests.server.conftest import make_settings

    cg, proc = tmp_path / "cgroup", tmp_path / "proc"
    write(cg, "cgroup.controllers", "cpu memory")
    write(cg, "simmer/memory.max", str(256 * MiB))
    write(cg, "simmer/memory.high", "max")
    write(cg, "simmer/memory.current", str(64 * MiB))
    write(cg, "simmer/memory.stat", f"inactive_file {16 * MiB}")
    write(proc, "self/cgroup", "0::/simmer")
    write(
        proc,
        "pressure/memory",
        "some avg10=1.50 avg60=0 avg300=0 total=0\nfull avg10=0.25 avg60=0 avg300=0 total=0",
    )
    overrides = {"thermal_source": "none", "cgroup_root": cg, "proc_root": proc}
    srv = live(governor=build_gate(make_settings(tmp_path, **overrides)), **overrides)
    body = srv.client().get("/v1/thermal").json()
    memory = body["memory"]
    assert memory["source"] == "cgroup-v2"
    assert memory["limit"] == 256 * MiB
    assert memory["used"] == 48 * MiB
    assert memory["available"] == 208 * MiB
    assert memory["psi"] == {"some_avg10": 1.5, "full_avg10": 0.25}
    assert body["temperature"]["source"] == "none"
    assert body["level"] == "nominal"


def test_thermal_events_when_lifecycle_changes_then_sse_state_events(live):
    gate = gate_for(ScriptedSensor(30.0))
    srv = live(governor=gate)
    seen: list[dict] = []
    with (
        httpx.Client(base_url=srv.url, timeout=10) as c,
        c.stream("GET", "/v1/thermal/events") as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                seen.append(json.loads(line.removeprefix("data: ")))
                if len(seen) == 1:
                    httpx.post(srv.url + "/v1/lifecycle", json={"state": "background"})
                elif seen[-1]["lifecycle"] == "background":
                    break
    assert seen[0]["lifecycle"] == "foreground"
    assert seen[-1]["level"] == "critical" and seen[-1]["limits"]["pause_new"] is True


def test_thermal_events_when_subscribers_reach_their_bound_then_429_and_health_still_answers(live):
    """SIMMER_MAX_CONNECTIONS=16: at most 2 event streams (an eighth), 1 per client (one address, no key
    here). A subscriber beyond gets 429 too_many_streams, /health and requests still get in, and a closed
    stream gives its place back."""
    srv = live(governor=gate_for(ScriptedSensor(30.0)), max_connections=16)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        with c.stream("GET", "/v1/thermal/events") as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator would close the stream
            next(line for line in lines if line.startswith("data: "))
            for _ in range(20):  # as an attacker keeps asking: no connection is held by a refusal
                extra = c.get("/v1/thermal/events")
                assert extra.status_code == 429 and extra.json()["error"]["code"] == "too_many_streams"
            assert c.get("/health").status_code == 200
        deadline = time.monotonic() + 5
        while True:
            with c.stream("GET", "/v1/thermal/events") as second:
                if second.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the closed stream's place did not come back"
            time.sleep(0.05)


@pytest.mark.parametrize("body", [{"state": "asleep"}, {}, {"state": "background", "extra": 1}])
def test_lifecycle_when_invalid_state_then_400_openai_error(live, body):
    srv = live(governor=gate_for(ScriptedSensor(30.0)))
    r = srv.client().post("/v1/lifecycle", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_parameter"


def test_thermal_when_no_governor_then_404(live):
    srv = live()
    assert srv.client().get("/v1/thermal").status_code == 404
