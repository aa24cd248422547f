"""Grammars a real `simmer serve` process must survive: one 85 KB JSON schema whose `$ref` chain overflowed
llguidance's native stack killed the process (a segfault, no exception), through every dialect that takes a
schema; a GBNF grammar of thousands of rules froze the event loop for 88 s and then crashed it. Here each is
sent to a server in a subprocess (a crash there fails this test instead of ending the test run), each must
be a 400 naming the field, and the process must still answer /health afterwards; three large GBNF grammars
converting at once must leave /health answering within 2 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.sustained.process import stop
from tests.server.processes import free_port, wait_ready

SERVE_SCRIPT = textwrap.dedent(
    """
    import sys
    from server.launch import serve
    from server.settings import Settings
    from tests.server.fakes import ScriptedEngine
    settings = Settings(port=int(sys.argv[1]), home=sys.argv[2], model="scripted-test", log_json=True,
                        thermal_source="none")
    serve(settings, engine_factory=lambda: ScriptedEngine(reply_tokens=4))
    """
)
HI = [{"role": "user", "content": "hi"}]


def ref_chain(n: int = 1300) -> dict:
    """The request that crashed the server: 85 KB, definitions each referring to the next."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"], "$defs": defs}


def gbnf_chain(rules: int, literal: str = "a") -> str:
    lines = ["root ::= r0", *(f'r{i} ::= "{literal}" r{i + 1} | "b"' for i in range(rules - 2))]
    return "\n".join([*lines, f'r{rules - 2} ::= "c"'])


CHAIN = ref_chain()
SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
FN = {"type": "function", "function": {"name": "f", "parameters": CHAIN}}
# (path, body, the field the 400 names)
CASES = [
    (
        "/v1/chat/completions",
        {
            "messages": HI,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CHAIN}},
        },
        "response_format",
    ),
    ("/v1/completions", {"prompt": "x", "json_schema": CHAIN}, "json_schema"),
    (
        "/v1/chat/completions",
        {"messages": HI, "tools": [FN], "tool_choice": "required"},
        "tools[0].function.parameters",
    ),
    (
        "/v1/responses",
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": CHAIN}}},
        "text.format",
    ),
    ("/api/chat", {"model": "scripted-test", "messages": HI, "format": CHAIN, "stream": False}, "format"),
    ("/api/generate", {"model": "scripted-test", "prompt": "x", "format": CHAIN, "stream": False}, "format"),
    ("/v1/completions", {"prompt": "x", "grammar": gbnf_chain(4000)}, "grammar"),
    ("/v1/completions", {"prompt": "x", "json_schema": SELF_REF}, "json_schema"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(port), str(tmp_path_factory.mktemp("crash"))],
        cwd=os.getcwd(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            stop(proc)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.mark.parametrize("path, body, param", CASES, ids=[f"{c[0]} {c[2]}" for c in CASES])
def test_grammar_when_deep_or_huge_then_400_and_the_process_survives(server, path, body, param) -> None:
    url, proc = server
    try:
        response = httpx.post(url + path, json=body, timeout=30)
    except httpx.TransportError as err:
        pytest.fail(f"the server died: exit code {proc.wait(5)} ({err!r})")
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    if path.startswith("/api/"):  # Ollama's shape names the field in the message
        assert error.startswith(f"{param}: ")
    else:
        assert error["param"] == param and error["code"] == "invalid_parameter", error
    assert proc.poll() is None
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_grammar_when_three_large_gbnf_at_once_then_health_keeps_answering(server) -> None:
    """62 KB grammars of 999 rules (within the bounds): converting them is off the event loop and linear,
    so /health answers within 2 s the whole time (it stalled 33.7 s)."""
    url, proc = server
    grammar = gbnf_chain(999, literal="x" * 40)
    assert 55_000 < len(grammar) <= 65_536
    results: list[int] = []

    def post() -> None:
        body = {"prompt": "x", "grammar": grammar, "max_tokens": 2}
        results.append(httpx.post(url + "/v1/completions", json=body, timeout=120).status_code)

    threads = [threading.Thread(target=post) for _ in range(3)]
    for t in threads:
        t.start()
    slowest = 0.0
    while any(t.is_alive() for t in threads):
        started = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert results == [200, 200, 200]
    assert slowest < 2.0, slowest
    assert proc.poll() is None


def test_grammar_when_the_crash_cases_are_the_issue_s_then_they_are_85_kb() -> None:
    """The chain is the size of the request that killed the server (guards the reproduction itself)."""
    assert 80_000 < len(json.dumps(CHAIN)) < 90_000
