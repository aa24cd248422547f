"""keep_alive with Ollama's meaning, one parser for every dialect (serving/keep_alive.py), table-driven."""

from __future__ import annotations

import math
import re

import pytest

from models.errors import InvalidParameter
from server.serving.keep_alive import FOREVER, MAX_FINITE_S, PATTERN, describe, parse_keep_alive

CASES = [
    (None, None),  # left out: the server's default
    ("5m", 300.0),
    ("1h30m", 5400.0),
    ("90s", 90.0),
    ("300ms", 0.3),
    ("1.5h", 5400.0),
    (".5s", 0.5),
    ("2h45m30.5s", 9930.5),
    ("10us", 1e-5),
    ("0", 0.0),  # unload right after the request
    ("0s", 0.0),
    ("-0s", 0.0),
    (0, 0.0),
    (0.0, 0.0),
    (30, 30.0),
    (2.5, 2.5),
    ("300", 300.0),  # OLLAMA_KEEP_ALIVE's plain seconds
    (" 5m\n", 300.0),
    ("+2h", 7200.0),
    (-1, FOREVER),  # negative: for ever
    (-0.5, FOREVER),
    ("-1m", FOREVER),
    ("-1", FOREVER),
    (10**400, FOREVER),  # longer than Go's Duration holds: for ever, not an overflow
    (-(10**400), FOREVER),
    (1e300, FOREVER),
    ("99999999999h", FOREVER),
]


@pytest.mark.parametrize(("value", "seconds"), CASES, ids=[repr(v)[:24] for v, _ in CASES])
def test_parse_keep_alive_when_valid_then_seconds(value, seconds) -> None:
    got = parse_keep_alive(value)
    assert got == seconds if seconds is None or seconds == FOREVER else math.isclose(got, seconds)


BAD = [
    "soon",
    "5 minutes",
    "5M",
    "5d",
    "m",
    "",
    "  ",
    "1e5",
    "--5m",
    "5m-",
    "h1",
    True,
    False,
    math.nan,
    math.inf,
]


@pytest.mark.parametrize("value", BAD, ids=[repr(v) for v in BAD])
def test_parse_keep_alive_when_not_a_duration_then_invalid_parameter_naming_it(value) -> None:
    with pytest.raises(InvalidParameter) as err:
        parse_keep_alive(value)
    assert err.value.param == "keep_alive"


@pytest.mark.parametrize("value", [v for v, _ in CASES if isinstance(v, str)] + BAD[:11])
def test_published_pattern_when_checked_then_agrees_with_the_parser(value) -> None:
    """The OpenAPI document publishes PATTERN: what it allows, the parser takes, and the other way round."""
    if not isinstance(value, str):
        return
    try:
        parse_keep_alive(value)
        parses = True
    except InvalidParameter:
        parses = False
    assert bool(re.search(PATTERN, value)) == parses


def test_describe_when_logged_then_words() -> None:
    assert [describe(v) for v in (None, FOREVER, 0.0, 300.0)] == [
        "default",
        "for ever",
        "unload at once",
        "300 s",
    ]
    assert MAX_FINITE_S > 290 * 365 * 86400
