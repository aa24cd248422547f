"""Errors shown in words a person understands: bad key, too long, busy, server gone."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.conftest import MODEL
from tests.ui.conftest import wait_until

pytestmark = pytest.mark.browser


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def error_text(page) -> str:
    page.wait_for_selector("#chat-error:not([hidden])")
    return page.inner_text("#chat-error")


def test_error_when_key_missing_then_page_asks_for_it_and_works_once_given(ui_server, open_page):
    srv = ui_server(reply_tokens=3, api_key="s3cret")
    page = open_page(srv, wait_model=False)  # /health is open: the model name shows without a key
    page.wait_for_selector("#key-dialog[open]")  # /v1/models answered 401: the page asks
    page.click("#key-cancel")
    send(page, "hello")
    assert "needs an API key" in error_text(page)
    assert page.input_value("#prompt") == "hello"  # given back to retry
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "s3cret")
    page.press("#key-input", "Enter")
    page.wait_for_selector("#key-dialog", state="hidden")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant .meta')?.textContent.includes('3 tokens')"
    )
    assert page.is_hidden("#chat-error")
    assert srv.engine.generations and len(srv.engine.generations) == 1


def test_error_when_conversation_too_long_then_explained_and_text_given_back(ui_server, open_page):
    srv = ui_server(context_length=64, reply_tokens=3)
    page = open_page(srv)
    long = "a long message " * 10
    send(page, long)
    text = error_text(page)
    assert "longer than the model can read" in text
    assert page.get_attribute("#chat-error", "data-code") == "context_length_exceeded"
    assert page.input_value("#prompt") == long
    assert page.locator(".msg.user.not-sent").count() == 1
    # With "drop oldest turns" ticked the same text is answered (the server truncates).
    page.check("#truncate")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant .meta')?.textContent.includes('tokens')"
    )
    assert "dropped" in page.inner_text(".msg.assistant .status")


def test_error_when_server_busy_then_says_so(ui_server, open_page):
    srv = ui_server(token_delay_s=0.05, reply_tokens=2000, max_queue=1)
    release = threading.Event()
    statuses: list[int] = []

    def hold() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        with (
            httpx.Client(base_url=srv.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            statuses.append(r.status_code)
            release.wait(20)

    def state() -> dict:
        return httpx.get(srv.url + "/health").json()

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    try:
        holders[0].start()  # one runs...
        assert wait_until(lambda: state()["busy"])
        holders[1].start()  # ...and one waits: the queue (max 1) is full
        assert wait_until(lambda: state()["queue_depth"] == 1)
        page = open_page(srv)
        send(page, "are you there?")
        assert "busy" in error_text(page)
        assert page.get_attribute("#chat-error", "data-code") == "server_busy"
        assert statuses[:1] == [200]  # the queued one gets its headers only when it starts
    finally:
        release.set()
        for t in holders:
            t.join(10)


def test_error_when_server_gone_then_cannot_reach_message(ui_server, open_page):
    srv = ui_server(reply_tokens=3)
    page = open_page(srv)
    srv.stop()
    send(page, "anyone?")
    assert "Cannot reach the simmer server" in error_text(page)
    assert page.get_attribute("#chat-error", "data-code") == "network"
