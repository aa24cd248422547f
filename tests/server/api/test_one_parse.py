"""A request's `max_tokens` and `model` go from each dialect's body to the engine through one translation
and one parse (server/serving/request.py), and nothing else in the server builds generation params or reads
a body's explicit fields."""

from __future__ import annotations

import ast
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.api.ollama import translate as ollama
from server.api.openai import translate as openai
from server.api.responses import translate as responses
from server.serving import request as internal
from tests.server.conftest import MODEL

SERVER = Path(__file__).resolve().parents[3] / "server"
HI = [{"role": "user", "content": "hi"}]

# route, body (asking for 3 tokens, naming the model), the translation it takes
WALKS = {
    "openai chat max_tokens": ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 3}),
    "openai chat max_completion_tokens": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "max_completion_tokens": 3, "max_tokens": 9},
    ),
    "openai completions": ("/v1/completions", {"model": MODEL, "prompt": "once", "max_tokens": 3}),
    "ollama chat": ("/api/chat", {"model": MODEL + ":latest", "messages": HI, "options": {"num_predict": 3}}),
    "ollama generate": ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"num_predict": 3}}),
    "ollama generate raw": (
        "/api/generate",
        {"model": MODEL, "prompt": "hi", "raw": True, "options": {"num_predict": 3}},
    ),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3}),
}
TRANSLATIONS: list[tuple[Any, str]] = [
    (openai, "chat_draft"),
    (openai, "completion_draft"),
    (ollama, "chat_draft"),
    (ollama, "generate_draft"),
    (responses, "draft"),
]


class Calls:
    """Every call of the translations and of the parse, wherever the server refers to them."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.drafts: list[internal.Draft] = []
        self.parsed: list[internal.GenerationRequest] = []

    def wrap(self, name: str, fn: Callable[..., Any], seen: list[Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count[name] += 1
            out = fn(*args, **kwargs)
            seen.append(out)
            return out

        return counted


@pytest.fixture
def calls(monkeypatch) -> Iterator[Calls]:
    """Patch each function in every server module that holds it (a `from ... import` copies the name)."""
    got = Calls()
    targets = [(mod, name, "translate", got.drafts) for mod, name in TRANSLATIONS]
    targets.append((internal, "parse", "parse", got.parsed))
    for mod, name, kind, seen in targets:
        original = getattr(mod, name)
        counted = got.wrap(kind, original, seen)
        for module in list(sys.modules.values()):
            if (module.__name__ or "").startswith("server.") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    yield got


@pytest.mark.parametrize("case", list(WALKS))
def test_walk_when_a_dialect_names_max_tokens_and_model_then_one_translation_and_one_parse(live, calls, case):
    route, body = WALKS[case]
    srv = live()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(route, json={"stream": False, **body})
    assert r.status_code == 200, r.text
    assert calls.count == Counter(translate=1, parse=1)
    (draft,), (parsed,) = calls.drafts, calls.parsed
    assert (draft.asked.max_tokens, draft.model) == (3, MODEL)
    assert (parsed.params.max_tokens, parsed.model) == (3, MODEL)
    assert srv.engine is not None and srv.engine.generations[-1].params == parsed.params


def _explicit_fields(node: ast.AST) -> bool:
    """`x.model_fields_set`, except `settings.model_fields_set` (which settings the environment gave)."""
    if not isinstance(node, ast.Attribute) or node.attr != "model_fields_set":
        return False
    return not (isinstance(node.value, ast.Name) and node.value.id == "settings")


def _calls(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            if name in names:
                found.append(f"{path.relative_to(SERVER.parent)}:{node.lineno} {name}")
        elif _explicit_fields(node):
            found.append(f"{path.relative_to(SERVER.parent)}:{node.lineno} model_fields_set")
    return found


# The terminal (`simmer run`) and the summarizer generate for themselves: no dialect, no request.
OWN_PARAMS = {"server/cli/run.py", "server/serving/summary.py"}


def test_one_parse_when_server_read_then_only_the_parse_builds_params_and_only_openai_reads_explicit_fields():
    found = [
        hit
        for path in sorted(SERVER.rglob("*.py"))
        for hit in _calls(path, {"GenerationParams", "SamplingParams"})
        if str(path.relative_to(SERVER.parent)) not in OWN_PARAMS
    ]
    builders = {hit.split(":")[0] for hit in found if "model_fields_set" not in hit}
    assert builders == {"server/serving/request.py"}, found
    explicit = {hit.split(":")[0] for hit in found if "model_fields_set" in hit}
    assert explicit == {"server/api/openai/translate.py"}, explicit
