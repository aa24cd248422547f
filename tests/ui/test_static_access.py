"""The page and its files load without the API key (the API still needs it); the Host check covers all."""

from __future__ import annotations

import socket

import httpx
import pytest

from server.serving.governor_setup import build_gate


def test_ui_when_api_key_set_then_page_and_static_open_but_api_closed(ui_server):
    srv = ui_server(api_key="s3cret")
    # a browser's navigation asks for HTML (without, `/` answers "Ollama is running", as Ollama does)
    browser = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
    with httpx.Client(base_url=srv.url, timeout=5, headers=browser) as c:
        page = c.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert 'src="/static/app.js"' in page.text
        for path in ("/static/app.js", "/static/style.css", "/static/js/sse.js"):
            assert c.get(path).status_code == 200, path
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    # The open prefix opens files, not the API behind a dotted path (sent raw: clients normalise "..").
    status_line, body = raw_get(srv.url, "/static/../v1/models")
    assert " 200 " not in status_line and '"object"' not in body


def raw_get(url: str, path: str) -> tuple[str, str]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.decode("latin-1").partition("\r\n\r\n")
    return head.splitlines()[0], body


def test_ui_when_host_header_foreign_then_page_refused(ui_server):
    srv = ui_server(api_key="s3cret")
    with httpx.Client(base_url=srv.url, timeout=5) as c:
        for path in ("/", "/static/app.js"):
            r = c.get(path, headers={"Host": "evil.example:8000"})
            assert r.status_code == 403
            assert r.json()["error"]["code"] == "host_not_allowed"


def test_ui_when_javascript_served_then_module_mime_type(ui_server):
    srv = ui_server()
    r = httpx.get(srv.url + "/static/js/chat.js", timeout=5)
    assert r.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")


@pytest.mark.browser
def test_ui_when_page_opened_then_no_request_fails(ui_server, browser):
    """Browsers ask for /favicon.ico unless the page names an icon; a 404 shows as a console error (the
    browser's own request, which no response event reports)."""
    srv = ui_server(gate_factory=build_gate, thermal_source="none")  # the governor's endpoints, as served
    context = browser.new_context()
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on(
            "console",
            lambda m: errors.append(f"{m.text} {m.location.get('url')}") if m.type == "error" else None,
        )
        page.goto(srv.url + "/")
        page.wait_for_function("() => document.getElementById('model-name').textContent !== ''")
        page.wait_for_timeout(500)
        assert errors == []
    finally:
        context.close()
