"""The chat says when a reply came from the upstream server, and why; a reply made on the device says
nothing more than before."""

from __future__ import annotations

import pytest

from tests.server.fakes import REPLY
from tests.ui.helpers import send, wait_reply_end

pytestmark = pytest.mark.browser


def test_chat_when_reply_served_upstream_then_tagged_with_reason(ui_server, open_page):
    upstream = ui_server(reply_tokens=6)  # a second simmer (scripted engine) stands in for the upstream
    srv = ui_server(route="upstream", upstream_url=upstream.url + "/v1", reply_tokens=6)
    page = open_page(srv)
    send(page, "hello there")
    state = wait_reply_end(page)
    assert REPLY.startswith(state["text"].strip()) and state["text"]
    reply = page.locator(".msg.assistant").last
    assert reply.get_attribute("data-route") == "upstream"
    tag = reply.locator(".route-tag")
    assert tag.text_content() == "upstream"
    assert (
        tag.get_attribute("title")
        == "Answered by the upstream server (the server sends every request upstream)"
    )
    assert state["meta"].startswith("Answered by the upstream server")
    assert len(upstream.engine.generations) == 1 and srv.engine.generations == []


def test_chat_when_reply_served_locally_then_no_upstream_tag(ui_server, open_page):
    srv = ui_server(reply_tokens=4)
    page = open_page(srv)
    send(page, "hi")
    state = wait_reply_end(page)
    reply = page.locator(".msg.assistant").last
    assert reply.get_attribute("data-route") == "local"
    assert reply.locator(".route-tag").count() == 0
    assert "upstream" not in state["meta"]
