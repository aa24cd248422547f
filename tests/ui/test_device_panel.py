"""The device panel against the real governor: a simulated heatwave changes the level, pauses the reply
and resumes it; the panel says the device is simulated and shows limits, memory and transitions."""

from __future__ import annotations

import pytest

from governor.sensors import make_thermal_source
from server.serving.governor_setup import build_gate
from tests.fakes import ScriptedCPU
from tests.ui.conftest import screenshot

pytestmark = pytest.mark.browser

TIME_SCALE = 30  # simulated seconds per wall second: slow enough for a loaded 2-core machine to react


def badge(page) -> str:
    return page.get_attribute("#level-badge", "data-level")


def test_panel_when_heatwave_then_level_changes_reply_pauses_and_resumes(ui_server, open_page):
    cpu = ScriptedCPU()

    def gate(settings):
        # Built as server/launch.py builds it, from the same thermal spec, with the CPU load scripted
        # through the simulator's cpu_time_fn seam so the test decides when the device works.
        thermal = make_thermal_source(
            settings.thermal_source, sim_time_scale=settings.sim_time_scale, cpu_time_fn=cpu, max_cores=2
        )
        return build_gate(settings, thermal=thermal)

    srv = ui_server(
        gate_factory=gate,
        thermal_source="sim:phone-heatwave",
        sim_time_scale=TIME_SCALE,
        governor_poll_s=2.0,
        # The level machine, which pauses at the throttling point: this scripted load ignores the governor
        # (two cores until the page shows the pause), and with pace control (the default) the pause is
        # the emergency's, 1 C below T_critical, which such a load overruns into a device kill.
        pace_control=False,
        token_delay_s=0.05,
        reply_tokens=80,
    )
    page = open_page(srv)
    page.wait_for_selector("#sim-note:not([hidden])")
    assert "Simulated device" in page.inner_text("#sim-note")
    assert "sim:phone-heatwave" in page.inner_text("#sim-note")
    page.wait_for_function(
        "() => document.getElementById('d-temperature').textContent.includes('throttles at 43')"
    )
    first_level = badge(page)
    assert first_level in ("nominal", "fair")
    assert page.inner_text("#d-paused") == "no"

    page.fill("#prompt", "keep talking")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 0")
    cpu.set(2.0)  # two busy cores in a heatwave: the forecast crosses the throttling point in seconds

    page.wait_for_selector(".msg.assistant[data-state='paused']")
    assert "governor" in page.inner_text(".msg.assistant .status")
    page.wait_for_function("() => document.getElementById('level-badge').dataset.level === 'critical'")
    assert page.get_attribute("#top-level-badge", "data-level") == "critical"
    assert page.inner_text("#d-paused") == "all replies paused"
    assert page.inner_text("#level-reason").startswith("thermal:")
    transitions = page.inner_text("#transitions")
    assert "critical" in transitions.lower() and "thermal:" in transitions
    screenshot(page, "ui-desktop-paused.png")

    cpu.set(0.0)  # paused, the device idles and cools; the governor steps down and the reply resumes
    page.wait_for_function(
        "() => document.getElementById('messages').getAttribute('aria-busy') === 'false'", timeout=25_000
    )
    assert "80 tokens" in page.inner_text(".msg.assistant .meta")
    assert badge(page) != "critical"
    # The chart has readings from both sides of the pause, and says what it shows.
    samples = page.evaluate("() => window.simmer.panel.samples.length")
    assert samples >= 3
    assert "throttling threshold" in page.get_attribute("#chart", "aria-label")
    assert page.inner_text("#d-threads") != "–"
    assert "used of" in page.inner_text("#d-memory")
