"""The page as an app: hidden tab = background app (Page Visibility API), the toggle, paused replies."""

from __future__ import annotations

import httpx
import pytest

from server.governor_setup import build_gate
from tests.ui.conftest import wait_until

pytestmark = pytest.mark.browser

# Headless Chromium never hides a page by itself: override what the Page Visibility API reports and
# fire its event, as the browser does when a tab goes to the background.
SET_HIDDEN = """(hidden) => {
  Object.defineProperty(document, 'hidden', {configurable: true, get: () => hidden});
  Object.defineProperty(document, 'visibilityState', {configurable: true,
                        get: () => (hidden ? 'hidden' : 'visible')});
  document.dispatchEvent(new Event('visibilitychange'));
}"""


def governed(ui_server, **kwargs):
    # No thermal sensor: only the lifecycle (and memory) move the level, so the test decides when.
    return ui_server(gate_factory=build_gate, thermal_source="none", **kwargs)


def lifecycle(srv) -> str:
    return httpx.get(srv.url + "/v1/thermal", timeout=5).json()["lifecycle"]


def test_lifecycle_when_page_hidden_then_server_background_and_back(ui_server, open_page):
    srv = governed(ui_server)
    page = open_page(srv)
    assert wait_until(lambda: lifecycle(srv) == "foreground")
    page.evaluate(SET_HIDDEN, True)
    assert wait_until(lambda: lifecycle(srv) == "background")
    page.wait_for_function(
        "() => document.getElementById('d-lifecycle').textContent.startsWith('background')"
    )
    page.evaluate(SET_HIDDEN, False)
    assert wait_until(lambda: lifecycle(srv) == "foreground")


def test_lifecycle_when_toggle_checked_then_background_until_unchecked(ui_server, open_page):
    srv = governed(ui_server)
    page = open_page(srv)
    page.get_by_label("Treat this page as a background app").check()
    assert wait_until(lambda: lifecycle(srv) == "background")
    page.wait_for_function("() => document.getElementById('level-badge').dataset.level === 'critical'")
    assert page.inner_text("#d-paused") == "all replies paused"
    page.get_by_label("Treat this page as a background app").uncheck()
    assert wait_until(lambda: lifecycle(srv) == "foreground")


def test_lifecycle_when_hidden_page_closes_then_server_back_in_foreground(ui_server, open_page):
    srv = governed(ui_server)
    page = open_page(srv)
    page.evaluate(SET_HIDDEN, True)
    assert wait_until(lambda: lifecycle(srv) == "background")
    page.close(run_before_unload=True)
    assert wait_until(lambda: lifecycle(srv) == "foreground")  # a closed tab must not pause the server


def test_reply_when_page_hidden_mid_reply_then_shows_paused_and_resumes_when_visible(ui_server, open_page):
    srv = governed(ui_server, token_delay_s=0.05, reply_tokens=30)
    page = open_page(srv)
    page.fill("#prompt", "a long story")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 0")
    page.evaluate(SET_HIDDEN, True)
    page.wait_for_selector(".msg.assistant[data-state='paused']")
    status = page.inner_text(".msg.assistant .status")
    assert "background" in status
    page.wait_for_timeout(150)  # a token already under way when the pause came may still land
    held = srv.engine.generations[0].tokens
    page.wait_for_timeout(300)  # paused for real: no token meanwhile
    assert srv.engine.generations[0].tokens == held < 30
    page.evaluate(SET_HIDDEN, False)
    page.wait_for_function("() => document.getElementById('messages').getAttribute('aria-busy') === 'false'")
    meta = page.inner_text(".msg.assistant .meta")
    assert "30 tokens" in meta  # resumed and finished, nothing lost
    assert page.get_attribute(".msg.assistant", "data-state") == "done"
