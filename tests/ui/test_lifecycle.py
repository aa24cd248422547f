"""The page as an app: hidden tab = background app (Page Visibility API), the toggle, paused replies."""

from __future__ import annotations

import httpx
import pytest

from server.serving.governor_setup import build_gate
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


def leases(srv) -> list[dict]:
    return httpx.get(srv.url + "/v1/thermal", timeout=5).json()["leases"]


def test_lifecycle_when_page_stays_hidden_then_it_renews_its_lease_past_the_ttl(ui_server, open_page):
    srv = governed(ui_server, lifecycle_ttl_s=3.0, governor_poll_s=0.05)
    page = open_page(srv)
    page.evaluate(SET_HIDDEN, True)
    assert wait_until(lambda: lifecycle(srv) == "background")
    (lease,) = leases(srv)
    client = page.evaluate("window.simmer.lifecycle.client")
    assert lease["client"] == client and client.startswith("page-")
    # Renewed every third of the TTL: three renewals take longer than the TTL, and the lease still holds.
    page.wait_for_function("() => window.simmer.lifecycle.renewals >= 3", timeout=20_000)
    assert lifecycle(srv) == "background" and [x["client"] for x in leases(srv)] == [client]
    page.evaluate(SET_HIDDEN, False)
    assert wait_until(lambda: lifecycle(srv) == "foreground")
    assert leases(srv) == []


def test_lifecycle_when_hidden_page_cannot_renew_then_lease_lapses_and_returns_with_it(ui_server, open_page):
    srv = governed(ui_server, lifecycle_ttl_s=1.5, governor_poll_s=0.05)
    page = open_page(srv)
    page.evaluate(SET_HIDDEN, True)
    assert wait_until(lambda: lifecycle(srv) == "background")
    page.route("**/v1/lifecycle", lambda route: route.abort())  # a frozen tab, a lost network
    assert wait_until(lambda: lifecycle(srv) == "foreground")  # nobody said foreground: the lease lapsed
    page.unroute("**/v1/lifecycle")
    assert wait_until(lambda: lifecycle(srv) == "background")  # still hidden: the next renewal takes it again
    page.evaluate(SET_HIDDEN, False)
    assert wait_until(lambda: lifecycle(srv) == "foreground")


def test_lifecycle_when_two_tabs_then_each_holds_its_own_lease(ui_server, open_page):
    srv = governed(ui_server)
    first, second = open_page(srv), open_page(srv)
    names = {page.evaluate("window.simmer.lifecycle.client") for page in (first, second)}
    assert len(names) == 2
    first.evaluate(SET_HIDDEN, True)
    second.evaluate(SET_HIDDEN, True)
    assert wait_until(lambda: {x["client"] for x in leases(srv)} == names)
    first.evaluate(SET_HIDDEN, False)  # one tab back: the other is still in the background
    assert wait_until(lambda: len(leases(srv)) == 1)
    assert lifecycle(srv) == "background"
    second.evaluate(SET_HIDDEN, False)
    assert wait_until(lambda: lifecycle(srv) == "foreground")
