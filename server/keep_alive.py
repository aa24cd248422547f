"""keep_alive as Ollama reads it: how long a model stays loaded after a request, counted from its end.

A number is seconds; a string is a Go duration ("5m", "1h30m", "90s", "250ms"); 0 unloads the model as soon
as the reply ends; a negative value keeps it loaded until the server stops (or memory is needed).
"""

from __future__ import annotations

import math
import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
FOREVER = math.inf
# the strings parse_keep_alive takes, for the published schema
PATTERN = r"^[+-]?(0|((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+)$"


def parse_keep_alive(value: float | int | str) -> float:
    """Seconds to keep the model loaded after the request: 0 = unload at once, math.inf = keep.
    Raises ValueError with the reason."""
    if isinstance(value, bool):
        raise ValueError('keep_alive must be a number of seconds or a duration such as "5m"')
    if isinstance(value, int | float):
        if math.isnan(value):
            raise ValueError("keep_alive must be a number")
        return FOREVER if value < 0 else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    if not body or _PART.sub("", body) != "" or not _PART.match(body):
        raise ValueError(
            f"keep_alive {value!r} is not a duration: use seconds (300), or a number with a unit "
            '("5m", "1h30m", "90s"); negative keeps the model loaded, 0 unloads it after this reply'
        )
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(body))
    return FOREVER if sign < 0 and seconds > 0 else seconds


def describe(seconds: float) -> str:
    if seconds == FOREVER:
        return "until the server stops"
    if seconds == 0:
        return "unloaded after the reply"
    return f"{seconds:g} s"
