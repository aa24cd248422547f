"""The pure parts of upstream.py: failure classification, Retry-After, the base URL, the forwarded body."""

from __future__ import annotations

import errno
import socket
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from server.routing.upstream import base_url, classify, forward_body, retry_after
from tests.server.requests import text_request


def connect_error(cause: BaseException) -> httpx.ConnectError:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise httpx.ConnectError("All connection attempts failed") from inner
    except httpx.ConnectError as err:
        return err


@pytest.mark.parametrize(
    ("cause", "kind"),
    [
        (OSError(errno.ENETUNREACH, "Network is unreachable"), "offline"),
        (OSError(errno.EHOSTUNREACH, "No route to host"), "offline"),
        (socket.gaierror(-2, "Name or service not known"), "offline"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "connect"),
        (ExceptionGroup("attempts", [OSError(errno.ENETUNREACH, "unreachable")]), "offline"),
    ],
)
def test_classify_when_connect_fails_then_offline_only_without_a_route(cause, kind) -> None:
    assert classify(connect_error(cause)).kind == kind


def test_classify_when_timeouts_and_drops() -> None:
    assert classify(httpx.ReadTimeout("slow")).kind == "timeout"
    assert classify(httpx.ConnectTimeout("slow")).kind == "timeout"
    assert classify(httpx.RemoteProtocolError("peer closed")).kind == "dropped"


def test_retry_after_when_seconds_date_or_garbage() -> None:
    assert retry_after("120") == 120.0
    assert retry_after(None) is None and retry_after("soon") is None
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    assert 55 <= retry_after(later) <= 61


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://gpu:8000", "http://gpu:8000/v1"),
        ("http://gpu:8000/", "http://gpu:8000/v1"),
        ("http://gpu:8000/v1/", "http://gpu:8000/v1"),
        ("https://llm.example.com/openai/v1", "https://llm.example.com/openai/v1"),
    ],
)
def test_base_url_when_bare_host_then_v1(url, expected) -> None:
    assert base_url(url) == expected


def test_forward_body_when_completion_then_prompt_and_explicit_fields_only() -> None:
    request = text_request(prompt="once", max_tokens=3, seed=1, truncate=True, route="upstream")
    assert forward_body(request, "up-name") == {
        "model": "up-name",
        "prompt": "once",
        "max_tokens": 3,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
