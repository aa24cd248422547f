"""A request's `keep_alive`, with Ollama's meaning: how long the model stays loaded after this request.

One parser for every dialect that takes it (Ollama's /api/* today; the model pool reads the parsed value
off the job). Accepted, as Ollama's api.Duration takes them:
- a number of seconds: 300, 0.5; negative = keep it loaded for ever;
- a Go duration string: "5m", "1h30m", "90s", "300ms", "-1m" (negative = for ever), "0";
- a string of a plain number of seconds, "300" (what OLLAMA_KEEP_ALIVE takes; Ollama's request parser
  wants a unit there, simmer does not insist).
0 means: unload right after this request. The result is seconds, FOREVER (math.inf) for "for ever";
None (the field left out) means the server's default (SIMMER_KEEP_ALIVE_S).
"""

from __future__ import annotations

import math
import re

from models.errors import InvalidParameter

FOREVER = math.inf
# Go's time.Duration holds at most 2**63 - 1 ns (about 292 years); a longer wish is "for ever" here.
MAX_FINITE_S = (2**63 - 1) / 1e9

# One pattern for the parser and the published schema (JSON Schema regexes are ECMA's; this one is both).
_DIGITS = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_UNITS = "ns|us|µs|μs|ms|s|m|h"
NUMBER = rf"[+-]?{_DIGITS}"
DURATION = rf"[+-]?(?:{_DIGITS}(?:{_UNITS}))+"
PATTERN = rf"^\s*(?:{NUMBER}|{DURATION})\s*$"
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PIECES = re.compile(rf"({_DIGITS})({_UNITS})")


def _clamp(seconds: float) -> float:
    if seconds < 0 or seconds > MAX_FINITE_S:
        return FOREVER
    return seconds


def parse_keep_alive(value: float | int | str | None, *, param: str = "keep_alive") -> float | None:
    """Seconds to keep the model loaded after the request (FOREVER, 0, or a positive number); None when
    the request left it out. Raises InvalidParameter, naming `param`, for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):  # JSON true is no duration (bool is an int to Python)
        raise InvalidParameter(f'{param} must be a duration such as "5m" or a number of seconds', param=param)
    if isinstance(value, int) and abs(value) > MAX_FINITE_S:  # beyond a float's range too, maybe
        return FOREVER
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise InvalidParameter(f"{param} must be a finite number of seconds", param=param)
        return _clamp(float(value))
    text = value.strip()
    if re.fullmatch(NUMBER, text):
        return _clamp(float(text))
    if not re.fullmatch(DURATION, text):
        raise InvalidParameter(
            f'{param} must be a duration such as "5m", "1h30m" or "-1" (for ever), or a number of seconds; '
            f"got {value!r}",
            param=param,
        )
    seconds = sum(float(n) * _UNIT_S[unit] for n, unit in _PIECES.findall(text))
    return _clamp(-seconds if text.startswith("-") and seconds > 0 else seconds)


def describe(seconds: float | None) -> str:
    """For logs and docs: "default", "for ever", "unload at once" or "300 s"."""
    if seconds is None:
        return "default"
    if seconds == FOREVER:
        return "for ever"
    return "unload at once" if seconds == 0 else f"{seconds:g} s"
