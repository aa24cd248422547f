"""Several models in the page: the model picker lists /v1/models and sends the chosen one; the device panel
shows the model in use, the ladder and its rung, and readable numbers."""

from __future__ import annotations

import httpx
import pytest

from governor.governor import Governor
from governor.limits import DEFAULT_TABLE, LevelLimits, Rung
from server.serving.governor_gate import GovernorGate
from server.serving.model_setup import serve_folders
from tests.ui.conftest import screenshot

pytestmark = pytest.mark.browser


def test_picker_when_several_models_then_lists_them_and_the_chosen_one_answers(
    ui_server, open_page, tiny_pair_dirs, tiny_base_model_dir
):
    folders = [*tiny_pair_dirs, tiny_base_model_dir]
    srv = ui_server(
        served_factory=lambda s: serve_folders(s, folders), model="tiny-small", context_length=128
    )
    page = open_page(srv)
    page.wait_for_function("() => document.querySelectorAll('#model-picker option').length === 3")
    options = page.eval_on_selector_all(
        "#model-picker option", "os => os.map(o => [o.dataset.model, o.value, o.disabled, o.textContent])"
    )
    by_model = {m: (value, disabled, label) for m, value, disabled, label in options}
    assert (
        by_model["tiny-small"][0] == "" and "(default)" in by_model["tiny-small"][2]
    )  # sent without a model
    assert "loaded" in by_model["tiny-small"][2] and "KB" in by_model["tiny-small"][2]  # disk size
    assert by_model["tiny-base"][1] is True and "no chat" in by_model["tiny-base"][2]  # a base model
    assert by_model["tiny-big"][1] is False

    page.select_option("#model-picker", "tiny-big")
    page.fill("#prompt", "hello")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.getElementById('messages').getAttribute('aria-busy') === 'false'")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny-big'")
    loaded = {m["id"]: m["loaded"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
    assert loaded["tiny-big"] is True


# a pace the governor computes from a measured cost: many decimals
PACE = 17.68033946251768
LADDER = [
    Rung("scripted-test", "q4-a8", 0.03, 0.93, 1),
    Rung("smaller", "q4-a8", 0.02, 0.9, 1),
]


def test_device_panel_when_ladder_and_pace_then_model_rung_and_readable_numbers(ui_server, open_page):
    table = {
        level: LevelLimits(**{**row.__dict__, "tokens_per_second": PACE})
        for level, row in DEFAULT_TABLE.items()
    }
    gate = GovernorGate(Governor(table=table, ladder=LADDER, usable_cpus=2, poll_s=0.2))
    srv = ui_server(governor=gate)
    page = open_page(srv)
    page.wait_for_function("() => document.getElementById('d-pace').textContent.includes('tok/s')")
    assert page.inner_text("#d-pace") == "17.7 tok/s"
    assert page.inner_text("#d-model") == "scripted-test (q4)"
    rungs = page.eval_on_selector_all("#d-ladder li", "ls => ls.map(l => [l.textContent, l.dataset.current])")
    assert rungs == [["scripted-test (q4-a8)", "true"], ["smaller (q4-a8)", "false"]]
    screenshot(page, "ui-desktop-ladder.png")
