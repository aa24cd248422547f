"""The hostile-input table: each request, as raw bytes on ONE keep-alive connection, gets its
expected status and error code, and the connection still serves the next request.

The server runs the tiny real model. Requests go through http.client, which sends paths, headers and
bodies exactly as written (httpx would normalise `/static/../..` away before it left the client).
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from models.runtime import engine as engine_module
from models.runtime.batch import BatchTraits
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.turns import TurnDecoder
from models.types import TokenEvent
from server.serving.contracts import Gate
from tests.server.api.hostile_cases import (
    BAD,
    CASES,
    CHAIN,
    CHAT,
    FN,
    HI,
    IP,
    JSON,
    SELF_REF,
    TEXT,
    Body,
    Case,
    fn,
    raw,
)
from tests.server.conftest import LiveServer, make_settings, start_server
from tests.server.fakes import HoldGate, PaceGate, ScriptedEngine
from tests.server.routing.hostile_upstream import HostileUpstream


@pytest.fixture(scope="module")
def hostile_server(tiny_model_dir: Path, tmp_path_factory) -> Iterator[tuple[LiveServer, DecoderEngine]]:
    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    pull_dir = tmp_path_factory.mktemp("pulls")  # SIMMER_PULL_DIRS: a file that is no GGUF, a link out
    (pull_dir / "notes.gguf").write_text("these are notes, not a model")
    (pull_dir / "passwd.gguf").symlink_to("/etc/passwd")
    settings = make_settings(
        tmp_path_factory.mktemp("hostile"),
        model=engine.model_id,
        cors_origins=["http://localhost:3000"],
        pull_dirs=[pull_dir],
    )
    srv = start_server(settings, engine=engine)
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def connection(hostile_server) -> Iterator[http.client.HTTPConnection]:
    srv, _ = hostile_server
    host, port = srv.host_header.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    yield conn
    conn.close()


def send(conn: http.client.HTTPConnection, host: str, case: Case, body: bytes | None):
    conn.putrequest(case.method, case.path, skip_host=True, skip_accept_encoding=True)
    headers = {"Host": host, **case.headers}
    for name, value in headers.items():
        conn.putheader(name, value)
    if body is not None or case.method == "POST":
        conn.putheader("Content-Length", str(len(body or b"")))
    conn.endheaders(body)
    response = conn.getresponse()
    return response, response.read()


def encode(case: Case, engine: DecoderEngine) -> bytes | None:
    body = case.body(engine) if callable(case.body) else case.body
    return json.dumps(body).encode() if isinstance(body, dict) else body


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_when_sent_then_expected_status_and_code_and_connection_still_serves(
    hostile_server, connection: http.client.HTTPConnection, case: Case
) -> None:
    srv, engine = hostile_server
    sock_before = connection.sock
    try:
        response, data = send(connection, srv.host_header, case, encode(case, engine))
    except (OSError, http.client.HTTPException):
        connection.close()  # so one broken case does not fail the rows after it
        raise
    assert response.status == case.status, data[:300]
    assert response.getheader("access-control-allow-origin") == case.allow_origin
    content_type = response.getheader("content-type", "")
    if case.code is not None:
        assert content_type.startswith("application/json")
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "code", "param"}
        assert error["code"] == case.code, error
        if case.param is not None:
            assert error["param"] == case.param, error
        assert error["message"] and "Traceback" not in error["message"]
    elif case.status == 200 and case.method == "POST":
        if content_type.startswith("text/event-stream"):
            assert b'"error"' not in data and data.rstrip().endswith(b"data: [DONE]")
        else:
            body = json.loads(data)
            assert body.get("error") is None and any(
                k in body for k in ("choices", "output", "tokens", "content")
            )
    # The connection survives: the same socket answers the next request, unless the server said it would
    # close it (then the client opens a new one, as any pooled client does).
    closing = (response.getheader("connection") or "").lower() == "close"
    assert sock_before is None or connection.sock is sock_before or closing
    response, data = send(
        connection, srv.host_header, Case("health", None, 200, path="/health", method="GET"), None
    )
    assert response.status == 200, data


# ---- Ollama's API: the same discipline, Ollama's error shape {"error": "message"} ----


@dataclass(frozen=True)
class OllamaCase:
    id: str
    path: str
    body: Body
    status: int
    words: str = ""  # in the error message (when an error is expected)
    code: str | None = None  # the simmer code behind it (its status is STATUS's)
    never: str = ""  # not in the error message (a file's content)
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    method: str = "POST"


def ochat(model: str = "{model}", **fields: Any) -> dict:
    return {"model": model, "messages": HI, "stream": False, "options": {"num_predict": 2}, **fields}


def pull(model: str) -> dict:
    return {"model": model, "stream": False}


def ogen(model: str = "{model}", **fields: Any) -> dict:
    return {"model": model, "prompt": "once", "stream": False, "options": {"num_predict": 2}, **fields}


OLLAMA_CASES = [
    OllamaCase("chat ok", "/api/chat", ochat(), 200),
    OllamaCase("chat streamed ok", "/api/chat", ochat(stream=True), 200),
    OllamaCase("generate ok", "/api/generate", ogen(), 200),
    OllamaCase("not JSON", "/api/chat", b'{"model": ', BAD, "not valid JSON", "invalid_json"),
    OllamaCase("empty body", "/api/chat", b"", BAD, "empty", "invalid_json"),
    OllamaCase("body a list", "/api/generate", b"[]", BAD, "JSON object", IP),
    OllamaCase("invalid UTF-8", "/api/chat", b'{"model": "\xff"}', BAD, "UTF-8", "invalid_json"),
    OllamaCase(
        "10k-level nesting", "/api/chat", b"[" * 10_000 + b"]" * 10_000, BAD, "nested", "invalid_json"
    ),
    OllamaCase(
        "surrogate in content",
        "/api/chat",
        raw('{"model": "m", "messages": [{"role": "user", "content": "a\\ud800"}]}'),
        BAD,
        "messages[0].content",
        IP,
    ),
    OllamaCase(
        "surrogate in an option",
        "/api/generate",
        raw('{"model": "m", "options": {"x": "\\udfff"}}'),
        BAD,
        "options.x",
        IP,
    ),
    OllamaCase(
        "temperature NaN",
        "/api/generate",
        raw('{"model": "m", "options": {"temperature": NaN}}'),
        BAD,
        "options.temperature",
        IP,
    ),
    OllamaCase(
        "top_p 1e400 (inf)",
        "/api/generate",
        raw('{"model": "m", "options": {"top_p": 1e400}}'),
        BAD,
        "options.top_p",
        IP,
    ),
    OllamaCase("seed 2**64", "/api/generate", ogen(options={"seed": 2**64}), BAD, "options.seed", IP),
    OllamaCase("seed int64 min", "/api/generate", ogen(options={"seed": -(2**63), "num_predict": 2}), 200),
    OllamaCase(
        "num_predict 10**30", "/api/generate", ogen(options={"num_predict": 10**30}, truncate=False), 200
    ),
    OllamaCase("top_k 10**30", "/api/chat", ochat(options={"top_k": 10**30, "num_predict": 2}), 200),
    OllamaCase("options a list", "/api/chat", ochat(options=[1]), BAD, "options", IP),
    OllamaCase("stream 'true'", "/api/chat", ochat(stream="true"), BAD, "stream", IP),
    OllamaCase(
        "keep_alive 1e400", "/api/chat", raw('{"model": "m", "keep_alive": 1e400}'), BAD, "keep_alive", IP
    ),
    OllamaCase("keep_alive 10**400", "/api/generate", ogen(keep_alive=10**400), 200),
    OllamaCase("keep_alive garbage", "/api/chat", ochat(keep_alive="5 minutes"), BAD, "keep_alive", IP),
    OllamaCase("messages a string", "/api/chat", ochat(messages="hi"), BAD, "messages", IP),
    OllamaCase(
        "prompt beyond the context, truncate false",
        "/api/generate",
        ogen(prompt="word " * 2000, truncate=False),
        BAD,
        "context",
        "context_length_exceeded",
    ),
    OllamaCase(
        "prompt beyond the context, Ollama's truncate",
        "/api/chat",
        ochat(messages=[{"role": "user", "content": "word " * 2000}]),
        200,
    ),
    OllamaCase("NUL bytes and emoji", "/api/generate", ogen(prompt="a\x00b 🙂👍🏽", raw=True), 200),
    # structured output and tools: the tiny model's 128 tokens hold no tools description, so the
    # 200s with tools use simmer's tool_choice "none"
    OllamaCase("format json", "/api/chat", ochat(format="json"), 200),
    OllamaCase(
        "format a schema, streamed", "/api/generate", ogen(format={"enum": ["a", "b"]}, stream=True), 200
    ),
    OllamaCase("format yaml", "/api/chat", ochat(format="yaml"), BAD, 'format must be "json"', IP),
    OllamaCase("format a list", "/api/chat", ochat(format=["json"]), BAD, "format", IP),
    OllamaCase(
        "format unsupported", "/api/generate", ogen(format={"not": {}}), BAD, "format: unsupported", IP
    ),
    OllamaCase("format with 2**80", "/api/chat", ochat(format={"enum": [2**80]}), 200),
    OllamaCase(
        "format: 85 KB $ref chain",
        "/api/chat",
        ochat(format=CHAIN),
        BAD,
        "format: the schema is too large",
        IP,
    ),
    OllamaCase("format: $ref cycle", "/api/generate", ogen(format=SELF_REF), BAD, "format: unsupported", IP),
    OllamaCase("tools, choice none", "/api/chat", ochat(tools=[FN], tool_choice="none"), 200),
    OllamaCase("tools a dict", "/api/chat", ochat(tools={"type": "function"}), BAD, "tools", IP),
    OllamaCase("tool name with a space", "/api/chat", ochat(tools=[fn(name="a b")]), BAD, "tools[0]", IP),
    OllamaCase(
        "tool parameters unsupported",
        "/api/chat",
        ochat(tools=[fn(parameters={"type": "object", "uniqueItems": True})]),
        BAD,
        "tools[0].function.parameters: unsupported",
        IP,
    ),
    OllamaCase(
        "tools and format", "/api/chat", ochat(tools=[FN], format="json"), BAD, "cannot be combined", IP
    ),
    OllamaCase(
        "tool call arguments a string",
        "/api/chat",
        ochat(
            messages=[
                *HI,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            ]
        ),
        BAD,
        "messages[1].tool_calls[0].function.arguments",
        IP,
    ),
    OllamaCase(
        "tool turn",
        "/api/chat",
        ochat(
            messages=[
                *HI,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "2", "tool_name": "f"},
            ]
        ),
        200,
    ),
    OllamaCase(
        "model ../../etc/passwd",
        "/api/chat",
        ochat(model="../../etc/passwd"),
        404,
        "not found",
        "model_not_found",
    ),
    OllamaCase("model with NUL", "/api/show", {"model": "a\x00b"}, 404, "not found", "model_not_found"),
    OllamaCase("show: model a number", "/api/show", {"model": 5}, BAD, "model", IP),
    OllamaCase("delete: no body", "/api/delete", b"", BAD, "empty", "invalid_json", method="DELETE"),
    OllamaCase(
        "delete: unknown",
        "/api/delete",
        {"model": "nope"},
        404,
        "not found",
        "model_not_found",
        method="DELETE",
    ),
    # a local path: only from SIMMER_PULL_DIRS, the same refusal whether the file exists or not (no oracle),
    # no byte of a file in any error
    OllamaCase("pull: /etc/passwd", "/api/pull", pull("/etc/passwd"), BAD, "SIMMER_PULL_DIRS", IP, "'root'"),
    OllamaCase(
        "pull: /proc/self/environ", "/api/pull", pull("/proc/self/environ"), BAD, "SIMMER_PULL_DIRS", IP
    ),
    OllamaCase("pull: a missing file", "/api/pull", pull("/etc/hostname.gguf"), BAD, "SIMMER_PULL_DIRS", IP),
    OllamaCase("pull: a file that is no GGUF", "/api/pull", pull("{not_gguf}"), BAD, "SIMMER_PULL_DIRS", IP),
    OllamaCase("pull: ~", "/api/pull", pull("~/x.gguf"), BAD, "SIMMER_PULL_DIRS", IP),
    OllamaCase(
        "pull: .. out of SIMMER_PULL_DIRS",
        "/api/pull",
        pull("{pull_dir}/../x.gguf"),
        BAD,
        "SIMMER_PULL_DIRS",
        IP,
    ),
    OllamaCase(
        "pull: a symlink out of SIMMER_PULL_DIRS",
        "/api/pull",
        pull("{pull_dir}/passwd.gguf"),
        BAD,
        "SIMMER_PULL_DIRS",
        IP,
        "'root'",
    ),
    OllamaCase(
        "pull: no GGUF in SIMMER_PULL_DIRS",
        "/api/pull",
        pull("{pull_dir}/notes.gguf"),
        BAD,
        "not a GGUF",
        "invalid_model_file",
        "these",
    ),
    OllamaCase(
        "pull: missing in SIMMER_PULL_DIRS",
        "/api/pull",
        pull("{pull_dir}/ghost.gguf"),
        404,
        "no such file",
        "model_not_found",
    ),
    # hf: names: no part may climb out of the download cache (it deleted and wrote files elsewhere)
    OllamaCase(
        "pull: hf: climbing out",
        "/api/pull",
        pull("hf:" + "../" * 12 + "etc/x.gguf@."),
        BAD,
        "plain name",
        IP,
    ),
    OllamaCase("pull: hf: revision ..", "/api/pull", pull("hf:owner/repo/x.gguf@.."), BAD, "plain name", IP),
    OllamaCase(
        "pull: hf: a backslash", "/api/pull", pull("hf:owner/repo/a\\..\\x.gguf"), BAD, "plain name", IP
    ),
    OllamaCase(
        "pull: hf: a 300-byte file name",
        "/api/pull",
        pull("hf:o/r/" + "a" * 300 + ".gguf"),
        BAD,
        "at most",
        IP,
    ),
    OllamaCase(
        "pull: hf: a 300-byte revision", "/api/pull", pull("hf:o/r/x.gguf@" + "b" * 300), BAD, "at most", IP
    ),
    OllamaCase("pull: unknown id", "/api/pull", {"model": "nope"}, 404, "unknown model", "model_not_found"),
    OllamaCase("pull: bad hf name", "/api/pull", {"model": "hf:x"}, BAD, "Hugging Face", IP),
    OllamaCase(
        "Content-Type text/plain",
        "/api/chat",
        ochat(),
        415,
        "Content-Type",
        "unsupported_content_type",
        headers={"Content-Type": "text/plain"},
    ),
    OllamaCase("60k empty messages", "/api/chat", ochat(messages=[{}] * 60_000), BAD, "at most", IP),
    OllamaCase("65 stop strings", "/api/chat", ochat(options={"stop": ["x"] * 65}), BAD, "at most", IP),
    OllamaCase("150k context ids", "/api/generate", ogen(context=[1] * 150_000), BAD, "at most", IP),
    OllamaCase("2 MB body", "/api/generate", ogen(prompt="x" * 2_000_000), 413, "over", "request_too_large"),
    OllamaCase(
        "embed: 100,000 inputs", "/api/embed", {"model": "m", "input": ["a"] * 100_000}, BAD, "at most", IP
    ),
    OllamaCase(
        "embed: truncate a string",
        "/api/embed",
        {"model": "m", "input": "a", "truncate": "no"},
        BAD,
        "truncate",
        IP,
    ),
    OllamaCase(
        "embed: a 1 MB input",
        "/api/embed",
        {"model": "m", "input": "word " * 200_000},
        413,
        "over",
        "request_too_large",
    ),
    OllamaCase(
        "foreign Host",
        "/api/tags",
        None,
        403,
        "Host",
        "host_not_allowed",
        headers={"Host": "evil.example"},
        method="GET",
    ),
    OllamaCase("wrong method", "/api/tags", None, 405, "Not Allowed", "method_not_allowed", method="DELETE"),
    OllamaCase("unknown path", "/api/nothing", None, 404, "Not Found", "not_found", method="GET"),
]


def render(body: Body, engine: DecoderEngine, not_gguf: str, pull_dir: Path) -> bytes | None:
    if isinstance(body, dict):
        text = json.dumps(body).replace('"{model}"', json.dumps(engine.model_id))
        text = text.replace("{pull_dir}", json.dumps(str(pull_dir))[1:-1])
        return text.replace('"{not_gguf}"', json.dumps(not_gguf)).encode()
    return body  # type: ignore[return-value]


@pytest.mark.parametrize("case", OLLAMA_CASES, ids=[c.id for c in OLLAMA_CASES])
def test_hostile_ollama_request_when_sent_then_status_and_ollama_error_and_connection_still_serves(
    hostile_server, connection: http.client.HTTPConnection, case: OllamaCase, tmp_path
) -> None:
    srv, engine = hostile_server
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("these are notes, not a model")
    as_case = Case(case.id, None, case.status, path=case.path, method=case.method, headers=case.headers)
    try:
        body = render(case.body, engine, str(not_gguf), srv.settings.pull_dirs[0])
        response, data = send(connection, srv.host_header, as_case, body)
    except (OSError, http.client.HTTPException):
        connection.close()
        raise
    assert response.status == case.status, data[:300]
    if case.status >= 400:
        body = json.loads(data)
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        assert case.words in body["error"] and "Traceback" not in body["error"], body
        assert not case.never or case.never not in body["error"], body
        if case.code is not None:
            from server.http.errors import STATUS

            assert STATUS[case.code][0] == case.status
    elif case.method == "POST":
        if response.getheader("content-type", "").startswith("application/x-ndjson"):
            lines = [json.loads(line) for line in data.splitlines() if line]
            assert lines[-1]["done"] is True and all("error" not in line for line in lines)
        else:
            assert json.loads(data)["done"] is True
    response, data = send(
        connection, srv.host_header, Case("health", None, 200, path="/health", method="GET"), None
    )
    assert response.status == 200, data


def test_hostile_cases_cover_every_error_code_the_request_path_can_send() -> None:
    """The table exercises each client-error code of server/http/errors.py that a request alone can cause."""
    from server.http.errors import STATUS

    # Codes a single request cannot cause on a healthy idle server (load, the governor, auth when no key
    # is set, a cancelled request, model installs) are covered by their own tests.
    elsewhere = {
        "model_not_installed",
        "invalid_api_key",
        "server_busy",
        "model_loading",
        "server_shutting_down",
        "insufficient_memory",
        "device_overheated",
        "device_paused",
        "cancelled",
        "model_not_chat",  # the tiny model has a template: tests/server/api/test_chat_template.py
        "wrong_model_kind",  # needs an embedding model installed: tests/server/api/test_embeddings.py
        "upstream_not_allowed",  # routing: tests/server/routing/
        "upstream_error",
        "upstream_unavailable",
        "insufficient_disk",  # model installs: tests/models/store/test_store_disk*.py
        "too_many_leases",  # 64 background leases first: tests/server/api/test_lifecycle_route.py
        "too_many_streams",  # open event streams first: tests/server/serving/test_governor_e2e.py
        "model_busy",  # a delete while the model loads: tests/server/serving/test_model_pool.py
        "verification_failed",  # changed files: tests/server/serving/test_model_integrity.py
        # a pull of a GGUF the converter refuses, or from a source that cannot be reached: tests/models/
        "unsupported_model",
        "unsupported_architecture",
        "unsupported_quantization",  # tests/models/convert/test_quant_convert.py
        "hash_mismatch",
        "source_unavailable",
    }
    covered = {c.code for c in CASES} | {c.code for c in OLLAMA_CASES}
    assert set(STATUS) - elsewhere <= covered, set(STATUS) - elsewhere - covered


# ---- the accepted values do what they say, over HTTP on the real model ----


def post(srv: LiveServer, path: str, body: dict) -> dict:
    with srv.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def token_texts(srv: LiveServer, **fields: Any) -> list[str]:
    body = {"prompt": "the cat", "max_tokens": 6, "logprobs": 0, "ignore_eos": True, **fields}
    return post(srv, TEXT, body)["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize("temperature", [0, 1.0, 2.0])
def test_logit_bias_when_plus_100_then_every_token_is_the_forced_one(hostile_server, temperature) -> None:
    srv, engine = hostile_server
    forced = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    texts = token_texts(srv, temperature=temperature, seed=3, logit_bias={str(forced): 100})
    assert texts == [engine.tokenizer.token_text(forced)] * 6


def test_logit_bias_when_minus_100_then_the_greedy_tokens_never_come(hostile_server) -> None:
    srv, engine = hostile_server
    greedy = set(token_texts(srv, temperature=0))
    ids = [i for i in range(engine.vocab_size) if engine.tokenizer.token_text(i) in greedy]
    banned = token_texts(srv, temperature=0, logit_bias={str(i): -100 for i in ids})
    assert not set(banned) & greedy


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_seed_when_negative_or_extreme_then_same_seed_same_reply(hostile_server, seed: int) -> None:
    srv, _ = hostile_server
    body = {"prompt": "once upon", "max_tokens": 12, "temperature": 1.5, "ignore_eos": True, "seed": seed}
    first = post(srv, TEXT, body)["choices"][0]["text"]
    assert post(srv, TEXT, body)["choices"][0]["text"] == first


# ---- a hostile upstream (SIMMER_ROUTE=upstream; tests/server/routing/hostile_upstream.py): every relayed
# reply is bounded in tokens, bytes and time, and nothing it reports becomes a 500 ----

STALL_S, DEADLINE_S = 3.0, 8.0  # the local server's upstream read (no token) and reply timeouts here


@dataclass(frozen=True)
class UpstreamCase:
    id: str
    behaviour: str  # what the hostile upstream does (the user message names it)
    status: int
    code: str | None = None  # the error code (in the body, or in the stream's error event)
    words: str = ""  # in the error message
    fields: dict = field(default_factory=dict)
    stream: bool = False
    finish: str | None = None  # the finish_reason of a 200
    tokens: int | None = None  # completion tokens of a 200


UPSTREAM_CASES = [
    UpstreamCase(
        "1 GB of valid chunks, max_tokens 10",
        "endless",
        200,
        fields={"max_tokens": 10},
        finish="length",
        tokens=10,
    ),
    UpstreamCase(
        "1 GB of valid chunks, streamed, max_tokens 7",
        "endless",
        200,
        fields={"max_tokens": 7},
        stream=True,
        finish="length",
        tokens=7,
    ),
    UpstreamCase("HTTP 500 with a 1 GB body", "error-gb", 503, "upstream_unavailable", "HTTP 500"),
    UpstreamCase("a 100 MB line", "long-line", 503, "upstream_unavailable", "over 262144 bytes"),
    UpstreamCase(
        "comment pings forever", "pings", 503, "upstream_unavailable", f"no token for {STALL_S:g} s"
    ),
    UpstreamCase(
        "a byte at a time forever", "drip", 503, "upstream_unavailable", f"no token for {STALL_S:g} s"
    ),
    UpstreamCase(
        "a token every 0.3 s forever", "slow-tokens", 502, "upstream_error", f"took over {DEADLINE_S:g} s"
    ),
    UpstreamCase(
        "a token every 0.3 s forever, streamed",
        "slow-tokens",
        200,
        "upstream_error",
        f"took over {DEADLINE_S:g} s",
        stream=True,
    ),
    UpstreamCase("usage.prompt_tokens of 400 digits", "usage-400-digits", 200, finish="stop"),
    UpstreamCase(
        "logprobs of 1e400 and 400 digits",
        "logprob-overflow",
        200,
        fields={"logprobs": True, "top_logprobs": 1},
        finish="stop",
    ),
    UpstreamCase("delta a string, content a number", "delta-not-an-object", 200, finish="stop"),
]


@pytest.fixture(scope="module")
def hostile_upstream(tmp_path_factory):
    upstream = HostileUpstream().start()
    settings = make_settings(
        tmp_path_factory.mktemp("hostile-upstream"),
        route="upstream",
        upstream_url=upstream.url,
        upstream_read_timeout_s=STALL_S,
        upstream_reply_timeout_s=DEADLINE_S,
        upstream_max_connections=2,
        upstream_breaker_failures=10_000,  # every row meets the upstream, however the last one went
        upstream_models={REMOTE_ENCODER: REMOTE_ENCODER},  # an embedding model served only upstream
    )
    srv = start_server(settings, engine=ScriptedEngine())
    yield srv, upstream
    srv.stop()
    upstream.stop()


def upstream_chat(
    srv: LiveServer, behaviour: str, *, stream: bool = False, **fields
) -> tuple[int, list[dict]]:
    """(status, the body as one dict, or a stream's data events)."""
    messages = [{"role": "user", "content": behaviour}]
    body = {"messages": messages, "stream": stream, "route": "upstream", **fields}
    with httpx.Client(base_url=srv.url, timeout=60) as client, client.stream("POST", CHAT, json=body) as r:
        if not stream:
            return r.status_code, [json.loads(r.read())]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return r.status_code, [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("case", UPSTREAM_CASES, ids=[c.id for c in UPSTREAM_CASES])
def test_hostile_upstream_when_relayed_then_bounded_and_never_a_500(
    hostile_upstream, case: UpstreamCase
) -> None:
    srv, _ = hostile_upstream
    status, got = upstream_chat(srv, case.behaviour, stream=case.stream, **case.fields)
    assert status == case.status, got[-1]
    errors = [g["error"] for g in got if "error" in g]
    if case.code is not None:
        assert errors and errors[-1]["code"] == case.code and case.words in errors[-1]["message"], errors
    else:
        assert not errors, errors
        last = got[-1]
        assert last["choices"][0]["finish_reason"] == case.finish
        usage = last.get("usage") or {}
        if case.tokens is not None and not case.stream:
            assert usage["completion_tokens"] == case.tokens
        if case.tokens is not None and case.stream:
            assert (
                sum(1 for g in got for c in g["choices"] if c.get("delta", {}).get("content")) <= case.tokens
            )
        if case.behaviour == "usage-400-digits":
            assert usage["prompt_tokens"] == 0  # out of range: not a count
    with srv.client() as client:
        assert client.get("/health").status_code == 200


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.parametrize(
    "behaviour", ["endless", "error-gb"], ids=["1 GB stream, no max_tokens", "1 GB error body"]
)
def test_hostile_upstream_when_a_gigabyte_then_rss_does_not_grow(hostile_upstream, behaviour: str) -> None:
    """Read in full, these took the process 1-1.5 GB up for good. The stream stops at the relay's token or
    text bound (or its deadline), the error body at 64 KB."""
    srv, _ = hostile_upstream
    before = rss_mb()
    status, got = upstream_chat(srv, behaviour)
    assert status in (200, 502, 503), got
    assert rss_mb() - before < 100


# Embeddings relayed (server/routing/embeddings.py): one answer, read bounded and checked whole. An answer
# that is not usable is a 502 naming what is wrong; no answer in the read timeout a 503; never a 500.
REMOTE_ENCODER = "remote-encoder"
EMBED_CASES = [
    # (id, the first input: the behaviour, fields, status, code, words in the message)
    ("a gigabyte of numbers", "gigabyte", {}, 502, "upstream_error", "is over 278784 bytes"),
    ("NaN", "nan", {}, 502, "upstream_error", "NaN"),
    ("1e400 and 400 digits", "overflow", {}, 502, "upstream_error", "out of range"),
    ("two vectors for one input", "two-vectors", {}, 502, "upstream_error", "2 vectors for 1 inputs"),
    ("2 dimensions, 3 asked", "two-dimensions", {"dimensions": 3}, 502, "upstream_error", "not 3"),
    ("strings and a bool", "strings", {}, 502, "upstream_error", "other than numbers"),
    ("not JSON", "not-json", {}, 502, "upstream_error", "not JSON"),
    ("a byte at a time forever", "drip", {}, 503, "upstream_unavailable", f"no answer in {STALL_S:g} s"),
    ("HTTP 500 with a 1 GB body", "error-gb", {}, 503, "upstream_unavailable", "HTTP 500"),
    ("a good answer", "ok", {}, 200, None, ""),
]


@pytest.mark.parametrize(
    ("behaviour", "fields", "status", "code", "words"),
    [c[1:] for c in EMBED_CASES],
    ids=[c[0] for c in EMBED_CASES],
)
def test_hostile_upstream_when_embeddings_relayed_then_checked_and_never_a_500(
    hostile_upstream, behaviour: str, fields: dict, status: int, code: str | None, words: str
) -> None:
    srv, _ = hostile_upstream
    before = rss_mb()
    body = {"model": REMOTE_ENCODER, "input": [behaviour], **fields}
    with srv.client() as client:
        r = client.post("/v1/embeddings", json=body, timeout=60)
        assert r.status_code == status, r.text
        if code is None:
            assert r.headers["x-simmer-route"] == "upstream; reason=policy"
            assert r.json()["data"][0]["embedding"] == [0.5, -0.25, 1.0]
            assert r.json()["model"] == REMOTE_ENCODER and r.json()["usage"]["prompt_tokens"] == 3
        else:
            error = r.json()["error"]
            assert error["code"] == code and words in error["message"], error
        assert client.get("/health").status_code == 200
    assert rss_mb() - before < 100


def test_hostile_upstream_when_ollama_embed_gets_nan_then_502_in_ollamas_shape(hostile_upstream) -> None:
    srv, _ = hostile_upstream
    with srv.client() as client:
        r = client.post("/api/embed", json={"model": REMOTE_ENCODER, "input": "nan"}, timeout=60)
    assert r.status_code == 502 and "NaN" in r.json()["error"], r.text


def test_hostile_upstream_when_slow_replies_fill_the_pool_then_the_next_request_is_still_served(
    hostile_upstream,
) -> None:
    """Two replies that drip a byte at a time hold both pooled connections; a third request waits for one
    (the relay ends a reply without a token after the read timeout) instead of a 503 after 3 s."""
    srv, _ = hostile_upstream
    results: dict[str, int] = {}

    def drip(i: int) -> None:
        results[f"drip{i}"] = upstream_chat(srv, "drip")[0]

    threads = [threading.Thread(target=drip, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # both drips hold their connections
    status, got = upstream_chat(srv, "ok")
    for t in threads:
        t.join()
    assert status == 200, got
    assert got[0]["choices"][0]["message"]["content"] == "hello world"
    assert results == {"drip0": 503, "drip1": 503}


# -- clients beside each other where replies take turns (models/runtime/turns.py) ----------------------------
# The batch probe forced to "rows differ" (AVX2's answer for SmolLM2's q4-a8): the engine offers turns, each
# reply in one-row passes of its own. Clients are told apart by their peer address (no API key): 127.0.0.2 is
# another machine's address on the loopback.


@pytest.fixture
def turns_server(live, tiny_model_dir: Path, monkeypatch) -> Callable[..., tuple[LiveServer, list[tuple]]]:
    """A server whose replies take turns, held at its first job until `release` (HoldGate); and the log of
    its turn decoder: ("add", slot, max_tokens) as a reply joins, ("token", slot) per token made."""
    differ = BatchTraits(rows=True, rows_alike=False, one_row_exact=False)
    monkeypatch.setattr(engine_module, "batch_traits", lambda sess: differ)
    log: list[tuple] = []
    add, prefill, step = TurnDecoder.add, TurnDecoder.prefill, TurnDecoder.step

    def added(self, prompt, params, **kw):
        slot = add(self, prompt, params, **kw)
        log.append(("add", slot, params.max_tokens))
        return slot

    def made(events: list) -> list:
        log.extend(("token", slot) for slot, ev in events if isinstance(ev, TokenEvent))
        return events

    monkeypatch.setattr(TurnDecoder, "add", added)
    monkeypatch.setattr(TurnDecoder, "prefill", lambda self, slot=None: made(prefill(self, slot)))
    monkeypatch.setattr(TurnDecoder, "step", lambda self: made(step(self)))

    def make(max_batch: int, gate: Gate, context_length: int = 128) -> tuple[LiveServer, list[tuple]]:
        engine = load_engine(tiny_model_dir, variant="q4-a8", threads=1, context_length=context_length)
        return live(engine=engine, model=engine.model_id, max_batch=max_batch, governor=gate), log

    return make


def turn_chat(
    srv: LiveServer, max_tokens: int, peer: str = "127.0.0.1", stream: bool = False
) -> httpx.Response:
    body = {
        "model": srv.settings.model,
        "messages": HI,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 7,  # sampled, and the same reply every time
    }
    transport = httpx.HTTPTransport(local_address=peer)
    with httpx.Client(base_url=srv.url, timeout=60, transport=transport) as c:
        return c.post(CHAT, json={**body, "stream": stream})


def wait_queued(srv: LiveServer, gate: HoldGate, n: int) -> None:
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 30
    while not (gate.holding.is_set() and worker.queue_depth == n):
        assert time.monotonic() < deadline, (gate.holding.is_set(), worker.queue_depth)
        time.sleep(0.01)


def test_turns_when_one_client_sends_ten_and_another_one_then_the_one_is_not_last(turns_server) -> None:
    """Two places, one client's ten requests queued before another's one: the other's goes at the first
    place free (its client runs nothing), not after the nine (first in first out would make it last)."""
    gate = HoldGate()
    srv, log = turns_server(2, gate)
    gate.release.clear()
    gate.holding.clear()
    codes: dict[str, int] = {}

    def send(name: str, max_tokens: int, peer: str) -> None:
        codes[name] = turn_chat(srv, max_tokens, peer).status_code

    many = [threading.Thread(target=send, args=(f"a{i}", 6, "127.0.0.1")) for i in range(10)]
    many[0].start()
    wait_queued(srv, gate, 0)
    for i, t in enumerate(many[1:], start=1):
        t.start()
        wait_queued(srv, gate, i)
    one = threading.Thread(target=send, args=("b", 5, "127.0.0.2"))
    one.start()
    wait_queued(srv, gate, 10)
    gate.release.set()
    for t in [*many, one]:
        t.join(60)
    assert sorted(codes.values()) == [200] * 11
    joined = [x[2] for x in log if x[0] == "add"]
    assert len(joined) == 11 and joined.index(5) == 1  # beside a's first, before a's other nine


def test_turns_when_a_client_never_reads_its_stream_then_the_worker_serves_the_others_and_ends_it(
    turns_server,
) -> None:
    """A client that sends a streaming request and does not read holds its connection, never the worker:
    the others are served beside it, its reply is made to the end while its stream is unread, and it gets
    all of it once it reads. (Loopback's socket buffers take the tiny model's whole reply, ~270 kB, so the
    server's writes here never stall: that the worker does not wait for a stalled write is by design, its
    sink an unbounded queue on the event loop, not shown by this test.)"""
    gate = HoldGate()
    srv, log = turns_server(4, PaceGate(200, gate), context_length=256)  # paced: the others come meanwhile
    host, port = srv.url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": srv.settings.model,
            "messages": HI,
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,  # ~1.3 kB a token
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + srv.host_header.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        deadline = time.monotonic() + 30
        while not any(x[0] == "add" and x[2] == 200 for x in log):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        others = [turn_chat(srv, 8, peer) for peer in ("127.0.0.1", "127.0.0.2")]
        assert [r.status_code for r in others] == [200, 200]
        assert [r.json()["usage"]["completion_tokens"] for r in others] == [8, 8]
        slot = next(x[1] for x in log if x[0] == "add" and x[2] == 200)
        start = log.index(("add", slot, 200))
        assert [x[2] for x in log[start:] if x[0] == "add"] == [200, 8, 8]
        other = next(k for k in range(start, len(log)) if log[k][0] == "add" and log[k][2] == 8)
        assert ("token", slot) in log[other:]  # served beside it
        worker = srv.app.state.runtime.worker
        while worker.busy:  # the unread reply is made to its end while its socket stays unread
            assert time.monotonic() < deadline, "the worker is held by a client that does not read"
            time.sleep(0.02)
        assert log[start:].count(("token", slot)) == 200
        sock.settimeout(30)  # it reads at last: the whole reply, to its end
        got = b""
        while b"data: [DONE]" not in got:
            chunk = sock.recv(1 << 16)
            assert chunk, "the stream ended early"
            got += chunk
        assert got.count(b'"logprob"') >= 200
    finally:
        sock.close()


def test_turns_when_a_client_resets_during_the_others_turns_then_they_stream_on_unchanged(
    turns_server,
) -> None:
    gate = HoldGate()
    srv, log = turns_server(4, PaceGate(150, gate))  # paced: the tiny model outruns a client's reset
    alone = [turn_chat(srv, 40).json()["choices"][0]["message"]["content"]]
    body = json.dumps(
        {"model": srv.settings.model, "messages": HI, "max_tokens": 100, "ignore_eos": True, "stream": True}
    ).encode()
    host, port = srv.url.removeprefix("http://").split(":")

    def reset() -> None:  # reads the start of its stream and resets the connection (no FIN)
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + srv.host_header.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        got = b""
        while got.count(b"data:") < 3:
            got += s.recv(4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

    gate.release.clear()
    gate.holding.clear()
    texts: list[str] = []
    stay = threading.Thread(
        target=lambda: texts.append(turn_chat(srv, 40).json()["choices"][0]["message"]["content"])
    )
    stay.start()
    wait_queued(srv, gate, 0)
    leaver = threading.Thread(target=reset)
    leaver.start()
    wait_queued(srv, gate, 1)
    gate.release.set()
    stay.join(60)
    leaver.join(60)
    assert texts == alone  # the same text as alone, whoever left beside it
    worker = srv.app.state.runtime.worker
    deadline = time.monotonic() + 10
    while worker.busy:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    joined = next(k for k, x in enumerate(log) if x[0] == "add" and x[2] == 100)
    assert 3 <= log[joined:].count(("token", log[joined][1])) < 100  # it ended when its client left
