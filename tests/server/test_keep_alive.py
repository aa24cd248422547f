"""keep_alive with Ollama's semantics."""

from __future__ import annotations

import math
import re

import pytest

from server.keep_alive import PATTERN, parse_keep_alive


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (0.0, 0.0),
        ("0", 0.0),
        (30, 30.0),
        (2.5, 2.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("90s", 90.0),
        ("250ms", 0.25),
        ("1.5h", 5400.0),
        (-1, math.inf),
        ("-1m", math.inf),
        ("-0", 0.0),
    ],
)
def test_parse_keep_alive(value, seconds):
    assert parse_keep_alive(value) == seconds
    if isinstance(value, str):
        assert re.match(PATTERN, value)  # the published schema takes what the parser takes


@pytest.mark.parametrize("value", ["", "5", "five minutes", "5 m", "m", "1d", True, float("nan")])
def test_parse_keep_alive_when_not_a_duration_then_value_error(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)
    if isinstance(value, str):
        assert not re.match(PATTERN, value)
