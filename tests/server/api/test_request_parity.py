"""Every dialect's request bodies reach the engine as they did when this table was recorded: the same
GenerationParams, messages or prompt, model, keep_alive and upstream body, and the same HTTP status and
error body for what is refused (the order of refusals included).

The bodies are the hostile table's (tests/server/api/test_hostile.py) for the five generation endpoints, plus
the Ollama and Responses rows below. What the router is handed (the seam between a dialect and where the
reply is served) is recorded, with what the engine then receives; tests/fixtures/request_parity.json holds
the recording. `SIMMER_RECORD_PARITY=1 pytest tests/server/api/test_request_parity.py` writes it again (only
when a change of behaviour is meant).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.routing.upstream import forward_body
from tests.server.api.hostile_cases import CASES, CHAIN, FN, HI, JSON, RESP, TEXT, chat, resp, text
from tests.server.conftest import MODEL, LiveServer, make_settings, start_server
from tests.server.fakes import RecordingEngine, ScriptedEngine
from tests.server.structured_data import CITY, TIME, WEATHER

FIXTURE = Path(__file__).parents[2] / "fixtures" / "request_parity.json"
RECORD = os.environ.get("SIMMER_RECORD_PARITY") == "1"

CHAT = "/v1/chat/completions"
OCHAT = "/api/chat"
OGEN = "/api/generate"
GENERATION_PATHS = (CHAT, TEXT, RESP, OCHAT, OGEN)
BAD_REF = {"$ref": "#/x"}
RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


def ochat(**fields: Any) -> dict:
    return {"model": MODEL, "messages": HI, "stream": False, "options": {"num_predict": 2}, **fields}


def ogen(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}, **fields}


ALL_OPTIONS = {
    "temperature": 0.5,
    "top_k": 3,
    "top_p": 0.9,
    "min_p": 0.1,
    "num_predict": 3,
    "seed": 7,
    "stop": "x",
    "repeat_penalty": 1.1,
    "presence_penalty": 0.2,
    "frequency_penalty": 0.3,
    "num_ctx": 100,
    "repeat_last_n": 4,
    "mirostat": 1,
}
TOOL_TURNS = [
    *HI,
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
    {"role": "tool", "content": "1", "tool_name": "f"},
]
RESP_ITEMS = [
    {"role": "developer", "content": "be brief"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"P"}'},
    {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"L"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
]

# (id, path, body, extra headers)
OWN: list[tuple[str, str, Any, dict[str, str]]] = [
    # OpenAI chat and completions: every field that reaches the engine or the upstream
    (
        "chat: every sampling field",
        CHAT,
        chat(
            max_completion_tokens=3,
            temperature=0.3,
            top_p=0.8,
            top_k=5,
            min_p=0.05,
            repeat_penalty=1.2,
            presence_penalty=0.1,
            frequency_penalty=-0.1,
            seed=11,
            stop="zz",
            logprobs=True,
            top_logprobs=2,
            logit_bias={"5": 1.5},
            ignore_eos=True,
            truncate=True,
            keep_alive="1m",
            route="local",
            governor_events=True,
            cache_salt="s",
            stream_options={"include_usage": True},
            user="u",
        ),
        {},
    ),
    ("chat: stop empty string", CHAT, chat(stop=""), {}),
    ("chat: stream, include_usage", CHAT, chat(stream=True, stream_options={"include_usage": True}), {}),
    (
        "chat: developer role, text parts",
        CHAT,
        chat(
            messages=[
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                *HI,
            ]
        ),
        {},
    ),
    ("chat: repetition_penalty alone", CHAT, chat(repetition_penalty=1.3), {}),
    (
        "chat: tools, choice none, parallel false",
        CHAT,
        chat(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False),
        {},
    ),
    (
        "chat: tools named choice",
        CHAT,
        chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
        {},
    ),
    ("chat: duplicate tool names", CHAT, chat(tools=[WEATHER, WEATHER]), {}),
    (
        "chat: tools and response_format",
        CHAT,
        chat(tools=[WEATHER], response_format={"type": "json_object"}),
        {},
    ),
    ("chat: top_logprobs without logprobs", CHAT, chat(top_logprobs=2), {}),
    ("chat: json_schema extra", CHAT, chat(json_schema=CITY), {}),
    ("chat: response_format text", CHAT, chat(response_format={"type": "text"}), {}),
    (
        "chat: json_object with schema",
        CHAT,
        chat(response_format={"type": "json_object", "schema": CITY}),
        {},
    ),
    ("chat: unknown model", CHAT, chat(model="nope"), {}),
    ("chat: unknown model, bad $ref", CHAT, chat(model="nope", json_schema=BAD_REF), {}),
    (
        "chat: unknown model, bad response_format",
        CHAT,
        chat(model="nope", response_format={"type": "yaml"}),
        {},
    ),
    ("chat: route upstream, none configured", CHAT, chat(route="upstream"), {}),
    ("chat: X-Simmer-Route bogus", CHAT, chat(), {"X-Simmer-Route": "sideways"}),
    ("chat: X-Simmer-Route local", CHAT, chat(), {"X-Simmer-Route": "local"}),
    ("chat: keep_alive bogus", CHAT, chat(keep_alive="soon"), {}),
    ("chat: keep_alive 0", CHAT, chat(keep_alive=0), {}),
    ("chat: model named", CHAT, chat(model=MODEL), {}),
    ("chat: model empty", CHAT, chat(model=""), {}),
    ("text: logprobs 2, prompt list", TEXT, text(prompt=["p"], logprobs=2, best_of=1, suffix=""), {}),
    (
        "text: every sampling field",
        TEXT,
        text(
            temperature=0.2, top_k=2, seed=-1, stop=["a", "b"], presence_penalty=0.5, repetition_penalty=1.05
        ),
        {},
    ),
    ("text: unknown model", TEXT, text(model="nope"), {}),
    ("text: tools ignored", TEXT, text(tools=[WEATHER]), {}),
    # Ollama's /api/chat
    ("ollama chat: plain", OCHAT, ochat(), {}),
    ("ollama chat: every option", OCHAT, ochat(options=ALL_OPTIONS), {}),
    (
        "ollama chat: num_predict -1, seed -1, stop list",
        OCHAT,
        ochat(options={"num_predict": -1, "seed": -1, "stop": ["a", "b"]}),
        {},
    ),
    ("ollama chat: no options", OCHAT, {"model": MODEL, "messages": HI, "stream": False}, {}),
    ("ollama chat: format json", OCHAT, ochat(format="json"), {}),
    ("ollama chat: format schema", OCHAT, ochat(format=CITY), {}),
    ("ollama chat: format empty", OCHAT, ochat(format=""), {}),
    ("ollama chat: format bad $ref", OCHAT, ochat(format=BAD_REF), {}),
    ("ollama chat: format type 5", OCHAT, ochat(format={"type": 5}), {}),
    ("ollama chat: format 85 KB chain", OCHAT, ochat(format=CHAIN), {}),
    ("ollama chat: format yaml", OCHAT, ochat(format="yaml"), {}),
    ("ollama chat: format and tools", OCHAT, ochat(format="json", tools=[WEATHER]), {}),
    ("ollama chat: tools", OCHAT, ochat(tools=[WEATHER, TIME]), {}),
    ("ollama chat: tools, choice none", OCHAT, ochat(tools=[FN], tool_choice="none"), {}),
    (
        "ollama chat: tools, named choice",
        OCHAT,
        ochat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        {},
    ),
    (
        "ollama chat: parameters type array",
        OCHAT,
        ochat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
        {},
    ),
    (
        "ollama chat: parameters 85 KB chain",
        OCHAT,
        ochat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": CHAIN}}],
            tool_choice="required",
        ),
        {},
    ),
    ("ollama chat: tool_choice without tools", OCHAT, ochat(tool_choice="auto"), {}),
    (
        "ollama chat: tool_choice unknown",
        OCHAT,
        ochat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "g"}}),
        {},
    ),
    ("ollama chat: duplicate tools", OCHAT, ochat(tools=[WEATHER, WEATHER]), {}),
    ("ollama chat: logprobs", OCHAT, ochat(logprobs=True, top_logprobs=3), {}),
    ("ollama chat: logprobs, no top", OCHAT, ochat(logprobs=True), {}),
    ("ollama chat: top_logprobs alone", OCHAT, ochat(top_logprobs=3), {}),
    ("ollama chat: top_logprobs 21", OCHAT, ochat(logprobs=True, top_logprobs=21), {}),
    ("ollama chat: keep_alive 5m", OCHAT, ochat(keep_alive="5m"), {}),
    ("ollama chat: keep_alive -1", OCHAT, ochat(keep_alive=-1), {}),
    ("ollama chat: keep_alive bogus", OCHAT, ochat(keep_alive="soon"), {}),
    ("ollama chat: truncate false, route local", OCHAT, ochat(truncate=False, route="local"), {}),
    ("ollama chat: :latest", OCHAT, ochat(model=MODEL + ":latest"), {}),
    ("ollama chat: unknown model", OCHAT, ochat(model="nope"), {}),
    ("ollama chat: unknown model, bad $ref", OCHAT, ochat(model="nope", format=BAD_REF), {}),
    ("ollama chat: tool turns", OCHAT, ochat(messages=TOOL_TURNS), {}),
    ("ollama chat: think", OCHAT, ochat(think=True), {}),
    ("ollama chat: images", OCHAT, ochat(messages=[{"role": "user", "content": "x", "images": ["aa"]}]), {}),
    ("ollama chat: temperature 3", OCHAT, ochat(options={"temperature": 3}), {}),
    ("ollama chat: seed 2**63", OCHAT, ochat(options={"seed": 2**63}), {}),
    ("ollama chat: stop empty", OCHAT, ochat(options={"stop": ""}), {}),
    ("ollama chat: repeat_penalty 0", OCHAT, ochat(options={"repeat_penalty": 0}), {}),
    ("ollama chat: streamed", OCHAT, {**ochat(), "stream": True}, {}),
    ("ollama chat: no model", OCHAT, {"messages": HI}, {}),
    ("ollama chat: load", OCHAT, {"model": MODEL}, {}),
    # Ollama's /api/generate
    ("ollama generate: plain", OGEN, ogen(), {}),
    ("ollama generate: system", OGEN, ogen(system="be brief"), {}),
    ("ollama generate: raw", OGEN, ogen(raw=True), {}),
    ("ollama generate: raw, logprobs", OGEN, ogen(raw=True, logprobs=True, top_logprobs=2), {}),
    ("ollama generate: raw, logprobs no top", OGEN, ogen(raw=True, logprobs=True), {}),
    ("ollama generate: raw, format json", OGEN, ogen(raw=True, format="json"), {}),
    ("ollama generate: raw, format bad $ref", OGEN, ogen(raw=True, format=BAD_REF), {}),
    ("ollama generate: raw, every option", OGEN, ogen(raw=True, options=ALL_OPTIONS), {}),
    ("ollama generate: raw and system", OGEN, ogen(raw=True, system="s"), {}),
    ("ollama generate: format schema", OGEN, ogen(format=CITY), {}),
    ("ollama generate: format bad $ref", OGEN, ogen(format=BAD_REF), {}),
    ("ollama generate: logprobs", OGEN, ogen(logprobs=True, top_logprobs=1), {}),
    ("ollama generate: suffix", OGEN, ogen(suffix="x"), {}),
    ("ollama generate: template", OGEN, ogen(template="{{ .Prompt }}"), {}),
    ("ollama generate: context", OGEN, ogen(context=[1, 2]), {}),
    ("ollama generate: unknown model", OGEN, ogen(model="nope"), {}),
    ("ollama generate: keep_alive 0", OGEN, ogen(keep_alive=0), {}),
    ("ollama generate: streamed", OGEN, {**ogen(), "stream": True}, {}),
    ("ollama generate: load", OGEN, {"model": MODEL, "prompt": ""}, {}),
    # the Responses API
    (
        "responses: every field",
        RESP,
        resp(
            instructions="be brief",
            temperature=0.4,
            top_p=0.7,
            top_k=4,
            min_p=0.02,
            repeat_penalty=1.1,
            seed=3,
            truncation="auto",
            include=["message.output_text.logprobs"],
            top_logprobs=2,
            route="local",
            governor_events=True,
            cache_salt="salt",
            store=True,
            metadata={"a": "b"},
            user="u",
            model=MODEL,
        ),
        {},
    ),
    ("responses: items", RESP, resp(input=RESP_ITEMS, tools=[RESP_TOOL]), {}),
    ("responses: include logprobs only", RESP, resp(include=["message.output_text.logprobs"]), {}),
    ("responses: top_logprobs only", RESP, resp(top_logprobs=1), {}),
    ("responses: truncation disabled", RESP, resp(truncation="disabled"), {}),
    (
        "responses: text.format json_schema",
        RESP,
        resp(text={"format": {"type": "json_schema", "name": "c", "schema": CITY}}),
        {},
    ),
    (
        "responses: text.format json_schema, no schema",
        RESP,
        resp(text={"format": {"type": "json_schema", "name": "c"}}),
        {},
    ),
    (
        "responses: text.format name with a space",
        RESP,
        resp(text={"format": {"type": "json_schema", "name": "a b", "schema": CITY}}),
        {},
    ),
    (
        "responses: text.format bad $ref",
        RESP,
        resp(text={"format": {"type": "json_schema", "name": "c", "schema": BAD_REF}}),
        {},
    ),
    (
        "responses: text.format 85 KB chain",
        RESP,
        resp(text={"format": {"type": "json_schema", "name": "c", "schema": CHAIN}}),
        {},
    ),
    ("responses: text.format text", RESP, resp(text={"format": {"type": "text"}}), {}),
    (
        "responses: tools",
        RESP,
        resp(tools=[RESP_TOOL], tool_choice="required", parallel_tool_calls=False),
        {},
    ),
    (
        "responses: tools, named choice",
        RESP,
        resp(tools=[RESP_TOOL], tool_choice={"type": "function", "name": "get_weather"}),
        {},
    ),
    (
        "responses: tools, unknown choice",
        RESP,
        resp(tools=[RESP_TOOL], tool_choice={"type": "function", "name": "nope"}),
        {},
    ),
    ("responses: duplicate tools", RESP, resp(tools=[RESP_TOOL, RESP_TOOL]), {}),
    (
        "responses: parameters type array",
        RESP,
        resp(tools=[{"type": "function", "name": "f", "parameters": {"type": "array"}}]),
        {},
    ),
    (
        "responses: parameters 85 KB chain",
        RESP,
        resp(tools=[{"type": "function", "name": "f", "parameters": CHAIN}], tool_choice="required"),
        {},
    ),
    (
        "responses: parameters bad $ref",
        RESP,
        resp(
            tools=[
                {
                    "type": "function",
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": BAD_REF}},
                }
            ]
        ),
        {},
    ),
    (
        "responses: tools and text.format",
        RESP,
        resp(tools=[RESP_TOOL], text={"format": {"type": "json_object"}}),
        {},
    ),
    (
        "responses: tools none and text.format",
        RESP,
        resp(tools=[RESP_TOOL], tool_choice="none", text={"format": {"type": "json_object"}}),
        {},
    ),
    ("responses: tool_choice required without tools", RESP, resp(tool_choice="required"), {}),
    ("responses: hosted tool", RESP, resp(tools=[{"type": "web_search"}]), {}),
    ("responses: empty input", RESP, resp(input=[]), {}),
    ("responses: item type image", RESP, resp(input=[{"type": "input_image", "image_url": "x"}]), {}),
    ("responses: reasoning high", RESP, resp(reasoning={"effort": "high"}), {}),
    ("responses: include other", RESP, resp(include=["file_search_call.results"]), {}),
    ("responses: unknown model", RESP, resp(model="nope"), {}),
    (
        "responses: unknown model, bad $ref",
        RESP,
        resp(model="nope", text={"format": {"type": "json_schema", "name": "c", "schema": BAD_REF}}),
        {},
    ),
    ("responses: streamed", RESP, resp(stream=True), {}),
    (
        "responses: function_call bad name",
        RESP,
        resp(input=[{"type": "function_call", "call_id": "c", "name": "a b", "arguments": "{}"}]),
        {},
    ),
]


def bodies() -> list[tuple[str, str, Any, dict[str, str]]]:
    """The hostile table's rows for the generation endpoints (JSON headers, own body), and ours."""
    rows = [
        (f"hostile: {c.id}", c.path, c.body, {})
        for c in CASES
        if c.method == "POST"
        and c.path in GENERATION_PATHS
        and c.headers == JSON
        and (isinstance(c.body, bytes | dict))
    ]
    return rows + OWN


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _plain(value: Any) -> Any:
    """JSON-ready: tuples as lists; long values (a prompt of 2,000 words, an 85 KB schema) by their digest."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: Any = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    elif isinstance(value, dict):
        out = {str(k): _plain(v) for k, v in value.items()}
    elif isinstance(value, list | tuple):
        out = [_plain(v) for v in value]
    else:
        out = value
    if isinstance(out, str | dict | list):
        text = out if isinstance(out, str) else json.dumps(out, sort_keys=True)
        if len(text) > LONG:
            return {"digest": _digest(text), "chars": len(text)}
    return out


LONG = 2000


def _params(params: Any) -> Any:
    out = _plain(params)
    if isinstance(out.get("grammar"), str):  # a long one is already a digest
        out["grammar"] = _digest(out["grammar"])
    return out


def _upstream(body: dict) -> dict:
    return _plain(body)


def observe(route: Any, job: Any, *rest: Any) -> dict[str, Any]:
    """What the router is handed: the job (where it runs, what it generates) and the upstream body it would
    forward."""
    request = job.request
    return {
        "side": route.side,
        "route_model": route.model,
        "kind": request.kind,
        "model": request.model,
        "payload": _plain(request.payload),
        "params": _params(request.params),
        "keep_alive_s": request.keep_alive_s,
        "governor_events": request.show.governor_events,
        "stream": job.account.stream if job.account else None,
        "endpoint": job.account.endpoint if job.account else None,
        "upstream": _upstream(forward_body(request, "up-model")),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[LiveServer, list[dict]]]:
    inner = ScriptedEngine(model_id=MODEL, reply_tokens=2, context_length=512)
    engine = RecordingEngine(inner)
    srv = start_server(make_settings(tmp_path_factory.mktemp("parity")), engine=engine)
    seen: list[dict] = []
    router = srv.app.state.runtime.router
    start = router.start

    def recording(route: Any, job: Any, *rest: Any) -> None:
        seen.append(observe(route, job, *rest))
        start(route, job, *rest)

    router.start = recording
    yield srv, seen
    srv.stop()


def run(srv: LiveServer, seen: list[dict], path: str, body: Any, headers: dict[str, str]) -> dict[str, Any]:
    seen.clear()
    assert srv.engine is not None
    before = len(srv.engine.generations)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", path, content=content, headers={**JSON, **headers}) as r,
    ):
        raw = r.read()
    out: dict[str, Any] = {"status": r.status_code}
    if r.status_code != 200:
        try:
            out["error"] = json.loads(raw)
        except ValueError:
            out["error"] = raw.decode("utf-8", "replace")
    out["routed"] = list(seen)
    gens = srv.engine.generations[before:]
    out["engine"] = [_params(g.params) for g in gens]
    return out


def _recorded() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


ROWS = bodies()


def test_parity_table_covers_every_generation_endpoint_with_enough_bodies():
    ids = [row[0] for row in ROWS]
    assert len(ids) == len(set(ids))
    per_path = {path: sum(1 for row in ROWS if row[1] == path) for path in GENERATION_PATHS}
    assert len(ROWS) >= 40 and all(n >= 8 for n in per_path.values()), per_path
    if not RECORD:
        assert set(_recorded()) == set(ids), "the recording and the table differ: record again"


def test_parity_every_body_reaches_the_engine_as_recorded(server):
    srv, seen = server
    got = {row_id: run(srv, seen, path, body, headers) for row_id, path, body, headers in ROWS}
    if RECORD:
        rows = (f"{json.dumps(k)}: {json.dumps(got[k], sort_keys=True)}" for k in sorted(got))
        FIXTURE.write_text("{\n" + ",\n".join(rows) + "\n}\n")  # one row a line: a diff names the body
        return
    recorded = _recorded()
    differ = [row_id for row_id in got if got[row_id] != recorded.get(row_id)]
    for row_id in differ[:5]:
        print(row_id, "\n recorded:", recorded.get(row_id), "\n now:     ", got[row_id])
    assert not differ, differ
