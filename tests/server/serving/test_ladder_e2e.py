"""The real pair on a ladder, end to end over HTTP: Gemma 3 270M (a base model, SentencePiece) over SmolLM2
135M (byte-level BPE). A scripted sensor (the governor's ThermalSource seam) heats the device mid-reply: the
governor's rung moves down to SmolLM2 and the reply goes on there (its text re-tokenized); the device cools
and the reply moves back up to Gemma. The stream reports both moves, its chunks name the model that wrote
them, and the usage says how many tokens each model produced."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from governor.governor import Governor
from governor.policy import PolicyConfig
from governor.sensors import TemperatureReading
from server.serving.governor_gate import GovernorGate
from server.serving.model_setup import serve_folders
from tests.server.conftest import make_settings

pytestmark = pytest.mark.slow

GEMMA, SMOL = "gemma3-270m", "smollm2-135m-instruct"
MAX_TOKENS = 96
COOL, WARM = 30.0, 42.0  # throttling at 43 C: 42 C is headroom 0.97, serious (one rung down)


class ScriptedSensor:
    """A thermal sensor whose temperature the test sets."""

    source = "psutil"
    simulator = None

    def __init__(self, celsius: float) -> None:
        self.celsius = celsius

    def read(self) -> TemperatureReading:
        return TemperatureReading(self.celsius, self.source, "scripted", 43.0, 48.0)


def test_ladder_when_device_heats_mid_reply_then_reply_moves_to_smollm2_and_back_and_completes(
    live, tmp_path, gemma3_served_dir, smollm2_model_dir, caplog
):
    caplog.set_level("INFO", logger="simmer.governor")
    overrides = {
        "model": GEMMA,
        "ladder": f"{GEMMA},{SMOL}",
        "memory_budget_mb": 4096,
        "context_length": 256,
        "threads": 2,
        "pause_timeout_s": 120.0,
    }
    settings = make_settings(tmp_path, **overrides)
    served = serve_folders(settings, [gemma3_served_dir, smollm2_model_dir])
    assert served.ladder[0].model_id == GEMMA and served.ladder[1].model_id == SMOL
    assert served.start is not None and served.start.index == 0 and served.preload == GEMMA

    sensor = ScriptedSensor(COOL)
    # forecast_s=0: a step to 42 C is a level, not a trend heading to critical; min_dwell_s=0: it steps
    # back down as soon as it has cooled. No memory reading: the shared machine's memory does not govern.
    governor = Governor(
        thermal=sensor,
        config=PolicyConfig(forecast_s=0.0, min_dwell_s=0.0),
        usable_cpus=2,
        ladder=served.ladder,
        start_rung=served.start.index,
        poll_s=0.02,
    )
    srv = live(served=served, governor=GovernorGate(governor, pause_timeout_s=120.0), **overrides)
    for _ in range(600):  # Gemma loads at start (/health says loading until it is in)
        if httpx.get(srv.url + "/health").json()["status"] == "ok":
            break
        time.sleep(0.1)

    body = {
        "prompt": "Once upon a time, in a small village by the sea,",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "governor_events": True,
    }
    chunks: list[tuple[str, str]] = []  # (model, text) in the order the client reads them
    switches: list[dict] = []
    usage: dict = {}
    done = False
    event = None
    with (
        httpx.Client(base_url=srv.url, timeout=300) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
                continue
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            data = json.loads(line.removeprefix("data: "))
            if event == "governor":
                if "switch" in data:
                    switches.append(data["switch"])
            elif "error" in data:
                raise AssertionError(data["error"])
            elif data.get("usage"):
                usage = data["usage"]
            elif data["choices"]:
                chunks.append((data["model"], "".join(ch["text"] for ch in data["choices"])))
                on_smol = [m for m, _ in chunks if m == SMOL]
                if len(chunks) == 1:
                    sensor.celsius = WARM  # heat once Gemma writes
                elif len(on_smol) >= 3:
                    sensor.celsius = COOL  # SmolLM2 has written a few chunks: cool down
            event = None

    assert done, "the stream did not complete"
    models = [m for m, _ in chunks]
    order = [m for i, m in enumerate(models) if i == 0 or models[i - 1] != m]
    assert order == [GEMMA, SMOL, GEMMA], order
    moves = [(s["old"].split("/")[0], s["new"].split("/")[0]) for s in switches]
    assert moves == [(GEMMA, SMOL), (SMOL, GEMMA)], switches
    # the switch events count the tokens generated before them; the chunks in between are SmolLM2's
    assert 0 < switches[0]["tokens_before"] < switches[1]["tokens_before"] < MAX_TOKENS
    assert usage["models"][SMOL] == switches[1]["tokens_before"] - switches[0]["tokens_before"]
    assert usage["models"][GEMMA] == MAX_TOKENS - usage["models"][SMOL]
    assert sum(usage["models"].values()) == usage["completion_tokens"] == MAX_TOKENS
    text = {m: "".join(t for n, t in chunks if n == m) for m in (GEMMA, SMOL)}
    assert text[GEMMA].strip() and text[SMOL].strip()
    assert governor.snapshot().level == "nominal"
    # every move of the governor's rung is logged as `old -> new: reason`
    gemma_rung, smol_rung = (f"{r.model_id}/{r.variant}" for r in served.ladder[:2])
    rung_moves = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rung ")]
    assert rung_moves[0].startswith(f"rung {gemma_rung} -> {smol_rung}: serious"), rung_moves
    assert any(m.startswith(f"rung {smol_rung} -> {gemma_rung}: ") for m in rung_moves[1:]), rung_moves
