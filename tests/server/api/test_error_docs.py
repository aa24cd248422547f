"""The error table in docs/server.md lists every code the server can send, with its status and type, and
nothing else: it is checked against server/http/errors.py so the two cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

from server.http.errors import STATUS
from server.http.openapi import ERROR_CODES

DOC = Path(__file__).resolve().parents[3] / "docs" / "server.md"
ROW = re.compile(r"^\| (\d{3}|other) \| `([a-z_]+)` \| `([a-z_]+)`")


def documented() -> dict[str, tuple[str, str]]:
    rows = [ROW.match(line) for line in DOC.read_text().splitlines()]
    return {m[2]: (m[1], m[3]) for m in rows if m}


def test_error_table_when_compared_with_errors_py_then_every_code_with_its_status_and_type() -> None:
    table = documented()
    expected = {code: (str(status), kind) for code, (status, kind) in STATUS.items()}
    expected["internal_error"] = ("500", "server_error")
    for code, row in expected.items():
        assert table.get(code) == row, f"docs/server.md: {code} should read {row}, reads {table.get(code)}"
    assert set(table) == set(expected) | {"http_error"}, set(table) ^ (set(expected) | {"http_error"})


def test_error_table_when_compared_with_openapi_then_same_codes() -> None:
    assert set(documented()) == set(ERROR_CODES)
