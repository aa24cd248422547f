"""Safe by default: Host header allow-list, API key, body limit, bind refusal, CORS."""

from __future__ import annotations

import httpx
import pytest

from models.errors import InvalidParameter
from server.http.security import check_bind, host_name, is_loopback

MSG = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("[::1]:8000", "::1"),
        ("127.0.0.1", "127.0.0.1"),
        ("Evil.com", "evil.com"),
        ("127.0.0.1:80@evil.example", ""),  # no host: it would have passed as 127.0.0.1
        ("[::1", ""),
        ("localhost:8000:1", ""),
        ("127.0.0.1 evil", ""),
    ],
)
def test_host_name_when_header_with_port_then_bare_name(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("127.0.0.2", True),
        ("0.0.0.0", False),
        ("192.168.1.5", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_check_bind_when_public_address_without_key_then_refused() -> None:
    with pytest.raises(InvalidParameter, match="API key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "secret")
    check_bind("127.0.0.1", None)


@pytest.mark.parametrize(
    "host",
    ["evil.example.com", "evil.example.com:8000", "192.168.1.10:8000", "127.0.0.1:80@evil.example", "[::1"],
)
def test_server_when_host_header_not_loopback_then_403(live, host: str) -> None:
    srv = live()
    r = httpx.post(srv.url + "/v1/chat/completions", json=MSG, headers={"Host": host})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["localhost:1234", "127.0.0.1", "[::1]:8000"])
def test_server_when_loopback_host_header_then_served(live, host: str) -> None:
    srv = live()
    r = httpx.post(srv.url + "/v1/chat/completions", json=MSG, headers={"Host": host})
    assert r.status_code == 200


def test_server_when_lan_client_with_the_right_key_and_a_foreign_host_then_403_naming_the_setting(
    live,
) -> None:
    """`--host 0.0.0.0` with a key: a LAN client that uses the machine's address must learn what to set."""
    srv = live(api_key="s3cret")
    headers = {"Host": "192.168.1.20:8000", "Authorization": "Bearer s3cret"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=MSG, headers=headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    message = r.json()["error"]["message"]
    assert "SIMMER_ALLOWED_HOSTS" in message and "192.168.1.20" in message, message
    allowed = live(api_key="s3cret", allowed_hosts=["192.168.1.20"])
    assert httpx.post(allowed.url + "/v1/chat/completions", json=MSG, headers=headers).status_code == 200


def test_server_when_host_in_allowed_hosts_then_served(live) -> None:
    srv = live(allowed_hosts=["simmer.lan"])
    r = httpx.post(srv.url + "/v1/chat/completions", json=MSG, headers={"Host": "simmer.lan:8000"})
    assert r.status_code == 200


def test_server_when_api_key_set_then_enforced_except_health(live) -> None:
    srv = live(api_key="s3cret")
    url = srv.url + "/v1/chat/completions"
    missing = httpx.post(url, json=MSG)
    wrong = httpx.post(url, json=MSG, headers={"Authorization": "Bearer nope"})
    right = httpx.post(url, json=MSG, headers={"Authorization": "Bearer s3cret"})
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200


def test_server_when_body_over_limit_then_413(live) -> None:
    srv = live(max_body_bytes=2000)
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(srv.url + "/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_server_when_chunked_body_over_limit_then_413(live) -> None:
    srv = live(max_body_bytes=2000)

    def body():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}]}'

    r = httpx.post(
        srv.url + "/v1/chat/completions", content=body(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413


def test_server_when_cors_origin_configured_then_only_it_allowed(live) -> None:
    srv = live(cors_origins=["http://localhost:3000"])
    pre = {"Access-Control-Request-Method": "POST"}
    ok = httpx.options(srv.url + "/v1/chat/completions", headers={"Origin": "http://localhost:3000", **pre})
    bad = httpx.options(srv.url + "/v1/chat/completions", headers={"Origin": "http://evil.com", **pre})
    assert ok.headers.get("access-control-allow-origin") == "http://localhost:3000"
    assert "access-control-allow-origin" not in bad.headers


def test_server_when_no_cors_configured_then_no_cors_headers(live) -> None:
    srv = live()
    r = httpx.post(srv.url + "/v1/chat/completions", json=MSG, headers={"Origin": "http://evil.com"})
    assert "access-control-allow-origin" not in r.headers


def test_server_when_no_cors_configured_then_a_preflight_gets_403_cors_not_allowed(live) -> None:
    srv = live()
    r = httpx.options(
        srv.url + "/v1/chat/completions",
        headers={"Origin": "http://evil.com", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "cors_not_allowed"
    assert "access-control-allow-origin" not in r.headers
