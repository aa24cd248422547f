"""A request's grammar is converted once and checked once, whichever dialect asks for it: a counting
Grammars (a fake through the real seam, serving/grammars.py) behind a live server, one request at a time."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import httpx
import pytest

from server.serving.grammars import LLGUIDANCE
from tests.server.conftest import MODEL
from tests.server.structured_data import ASK, CITY, TIME, WEATHER

RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
OLLAMA_OPTIONS = {"num_predict": 4}


class CountingGrammars:
    """The real conversions and checks, counted."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def json_schema(self, schema: dict[str, Any] | None, param: str) -> str:
        self._count("convert")
        return LLGUIDANCE.json_schema(schema, param)

    def gbnf(self, text: str, param: str) -> str:
        self._count("convert")
        return LLGUIDANCE.gbnf(text, param)

    def check(self, grammar: str, param: str) -> None:
        self._count("check")
        LLGUIDANCE.check(grammar, param)


# (route, body, grammars the request asks for: its response grammar, or one per tool with parameters)
CASES = {
    "openai chat json_schema": (
        "/v1/chat/completions",
        {
            "messages": ASK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
        },
        1,
    ),
    "openai chat json_object": (
        "/v1/chat/completions",
        {"messages": ASK, "response_format": {"type": "json_object"}},
        1,
    ),
    "openai chat tools": ("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER, TIME]}, 2),
    "openai completions gbnf": ("/v1/completions", {"prompt": "Yes?", "grammar": 'root ::= "yes" | "no"'}, 1),
    "openai completions json_schema": ("/v1/completions", {"prompt": "City?", "json_schema": CITY}, 1),
    "ollama chat format": ("/api/chat", {"messages": ASK, "format": CITY, "options": OLLAMA_OPTIONS}, 1),
    "ollama generate format json": (
        "/api/generate",
        {"prompt": "City?", "format": "json", "options": OLLAMA_OPTIONS},
        1,
    ),
    "ollama chat tools": (
        "/api/chat",
        {"messages": ASK, "tools": [WEATHER, TIME], "options": OLLAMA_OPTIONS},
        2,
    ),
    "responses text.format": (
        "/v1/responses",
        {"input": "Paris?", "text": {"format": {"type": "json_schema", "name": "c", "schema": CITY}}},
        1,
    ),
    "responses tools": ("/v1/responses", {"input": "Paris?", "tools": [RESPONSES_TOOL]}, 1),
}


@pytest.mark.parametrize("stream", [False, True], ids=["reply", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_grammar_when_a_dialect_asks_for_one_then_converted_once_and_checked_once(live, case, stream):
    route, body, grammars = CASES[case]
    counting = CountingGrammars()
    srv = live(grammars=counting, reply_tokens=3)
    length = (
        {}
        if route.startswith("/api/")
        else {"max_output_tokens" if "responses" in route else "max_tokens": 4}
    )
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(route, json={"model": MODEL, "stream": stream, **length, **body})
        assert r.status_code == 200, r.text
        r.read()  # a stream to its end
    assert counting.calls == Counter(convert=grammars, check=grammars)
