"""The hostile-input table (one `Case` per request: body, expected status, error code and field), shared
by tests/server/api/test_hostile.py, which sends each as raw bytes, and the request parity recording."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from models.runtime.engine import DecoderEngine

CHAT = "/v1/chat/completions"

TEXT = "/v1/completions"

HI = [{"role": "user", "content": "hi"}]

JSON = {"Content-Type": "application/json"}

Body = bytes | dict | Callable[[DecoderEngine], dict] | None


@dataclass(frozen=True)
class Case:
    id: str
    body: Body
    status: int
    code: str | None = None  # the error code; None for a success
    param: str | None = None  # the field the error names (checked when given)
    path: str = CHAT
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    allow_origin: str | None = None  # the Access-Control-Allow-Origin expected (None: absent)


RESP = "/v1/responses"

EMB = "/v1/embeddings"


def resp(**fields: Any) -> dict:
    return {"input": "hi", "max_output_tokens": 2, **fields}


def emb(**fields: Any) -> dict:
    return {"model": "any", "input": "hi", **fields}


def chat(**fields: Any) -> dict:
    return {"messages": HI, "max_tokens": 2, **fields}


def text(**fields: Any) -> dict:
    return {"prompt": "once", "max_tokens": 2, **fields}


def raw(obj_text: str) -> bytes:
    """JSON written by hand: lone surrogates and NaN, which json.dumps would not write."""
    return obj_text.encode()


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def deep(levels: int) -> list:
    """A value `levels` lists deep, inside a body that adds one more level."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def fn(**function: Any) -> dict:
    return {"type": "function", "function": {**FN["function"], **function}}


def ref_chain(n: int, *, objects: bool = False) -> dict:
    """Definitions each referring to the next; 1,300 of them (85 KB) overflowed llguidance's native stack
    and killed the server (tests/server/http/test_grammar_crash.py is the subprocess version)."""
    if objects:
        defs = {
            f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
        }
    else:
        defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"], "$defs": defs}


def gbnf_chain(rules: int) -> str:
    lines = ["root ::= r0", *(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(rules - 2))]
    return "\n".join([*lines, f'r{rules - 2} ::= "c"'])


CHAIN = ref_chain(1300)

SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}

BAD = 400

IP = "invalid_parameter"

HI_JSON = '{"messages": [{"role": "user", "content": "hi"}], '

CASES = [
    # defect 1: sampling values the validation accepts must not give a 500; extreme penalties are refused
    Case("temperature 1e-40", chat(temperature=1e-40), 200),
    Case("temperature 5e-324", chat(temperature=5e-324), 200),
    Case("temperature 1e-40 streamed", chat(temperature=1e-40, stream=True), 200),
    Case("repeat_penalty 5e-324", chat(repeat_penalty=5e-324), BAD, IP, "repeat_penalty"),
    Case("repetition_penalty 5e-324", chat(repetition_penalty=5e-324), BAD, IP, "repetition_penalty"),
    Case("repetition_penalty 1e308", chat(repetition_penalty=1e308), BAD, IP, "repetition_penalty"),
    Case("repetition_penalty at both ends", chat(repeat_penalty=0.01, repetition_penalty=100), 200),
    Case("temperature NaN", raw(HI_JSON + '"temperature": NaN}'), BAD, IP, "temperature"),
    Case("top_p 1e400 (inf)", raw(HI_JSON + '"top_p": 1e400}'), BAD, IP, "top_p"),
    Case("top_k 10**30", chat(top_k=10**30), 200),
    Case("max_tokens 10**30", chat(max_tokens=10**30), 200),
    # defect 2: every int64 seed, outside it a 400
    Case("seed -1", chat(seed=-1, temperature=1.5), 200),
    Case("seed int64 min", chat(seed=-(2**63)), 200),
    Case("seed int64 max", chat(seed=2**63 - 1), 200),
    Case("seed 2**63", chat(seed=2**63), BAD, IP, "seed"),
    Case("seed -2**63-1", chat(seed=-(2**63) - 1), BAD, IP, "seed"),
    Case("seed 2**64", text(seed=2**64), BAD, IP, "seed"),
    # defect 3: lone surrogates, wherever they are
    Case(
        "surrogate in content",
        raw('{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        BAD,
        IP,
        "messages[0].content",
    ),
    Case(
        "surrogate in a text part",
        raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
        BAD,
        IP,
        "messages[0].content[0].text",
    ),
    Case("surrogate in prompt", raw('{"prompt": "x\\udc00"}'), BAD, IP, "prompt", TEXT),
    Case("surrogate in stop", raw('{"prompt": "x", "stop": ["ok", "\\ud83d"]}'), BAD, IP, "stop[1]", TEXT),
    Case(
        "surrogate in model",
        raw('{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'),
        BAD,
        IP,
        "model",
    ),
    Case("surrogate in an ignored field", raw(HI_JSON + '"x": "\\ud800"}'), BAD, IP, "x"),
    Case(
        "surrogate pair (an emoji) is fine",
        raw('{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'),
        200,
    ),
    # defect 11: no silently ignored fields, no coercion, JSON problems are invalid_json
    Case("logit_bias in vocabulary", chat(logit_bias={"5": 100, "6": -100}), 200),
    Case(
        "logit_bias beyond the vocabulary",
        lambda e: chat(logit_bias={str(e.vocab_size): 1}),
        BAD,
        IP,
        "logit_bias",
    ),
    Case("logit_bias key not a number", chat(logit_bias={"abc": 1}), BAD, IP, "logit_bias.abc"),
    Case("logit_bias value 101", chat(logit_bias={"5": 101}), BAD, IP, "logit_bias.5"),
    Case(
        "logit_bias streamed, beyond the vocabulary",
        lambda e: chat(stream=True, logit_bias={"99999999": 1}),
        BAD,
        IP,
        "logit_bias",
    ),
    Case("tool_choice", chat(tool_choice="auto"), BAD, IP, "tool_choice"),
    Case("tool_choice none", chat(tool_choice="none"), BAD, IP, "tool_choice"),
    # tools; the tiny model's 128 tokens hold no tools description, so the 200s use "none"
    Case("tools, choice none", chat(tools=[FN], tool_choice="none"), 200),
    Case("tools not a list", chat(tools={"type": "function"}), BAD, IP, "tools"),
    Case(
        "tool type not function",
        chat(tools=[{"type": "web", "function": FN["function"]}]),
        BAD,
        IP,
        "tools[0].type",
    ),
    Case("function name with a space", chat(tools=[fn(name="a b")]), BAD, IP, "tools[0].function.name"),
    Case("function name 65 chars", chat(tools=[fn(name="a" * 65)]), BAD, IP, "tools[0].function.name"),
    Case("parameters a string", chat(tools=[fn(parameters="{}")]), BAD, IP, "tools[0].function.parameters"),
    Case(
        "parameters type array",
        chat(tools=[fn(parameters={"type": "array"})]),
        BAD,
        IP,
        "tools[0].function.parameters",
    ),
    Case(
        "parameters uniqueItems",
        chat(tools=[fn(parameters={"type": "object", "uniqueItems": True})]),
        BAD,
        IP,
        "tools[0].function.parameters",
    ),
    Case(
        "tool_choice unknown function",
        chat(tools=[FN], tool_choice={"type": "function", "function": {"name": "g"}}),
        BAD,
        IP,
        "tool_choice",
    ),
    Case("tool_choice 'always'", chat(tools=[FN], tool_choice="always"), BAD, IP, "tool_choice"),
    Case(
        "parallel_tool_calls 'yes'",
        chat(tools=[FN], parallel_tool_calls="yes"),
        BAD,
        IP,
        "parallel_tool_calls",
    ),
    # an integer beyond 64 bits in a schema is read (it was a 500); the prompt with tools is then too long
    Case(
        "parameters with 2**80",
        chat(tools=[fn(parameters={"type": "object", "x": 2**80})], tool_choice="required"),
        BAD,
        "context_length_exceeded",
    ),
    Case(
        "schema with 2**80",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"enum": [2**80]}}}),
        200,
    ),
    Case(
        "tool turn",
        {"messages": [*HI, {"role": "tool", "tool_call_id": "c", "content": "1"}], "max_tokens": 2},
        200,
    ),
    Case(
        "tool_calls arguments an object",
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
        BAD,
        IP,
        "messages[0].tool_calls[0].function.arguments",
    ),
    Case("echo 0", text(echo=0), BAD, IP, "echo", TEXT),
    Case("max_tokens '5'", chat(max_tokens="5"), BAD, IP, "max_tokens"),
    Case("stream 'true'", chat(stream="true"), BAD, IP, "stream"),
    Case("temperature as a bool", chat(temperature=True), BAD, IP, "temperature"),
    Case("temperature as an int is a number", chat(temperature=1), 200),
    Case("n 2", chat(n=2), 200),
    Case("n 9", chat(n=9), BAD, IP, "n"),
    Case("n 0", chat(n=0), BAD, IP, "n"),
    Case("n 2 streamed", chat(n=2, stream=True), 200),
    Case("max_tokens 0", chat(max_tokens=0), BAD, IP, "max_tokens"),
    Case("max_tokens 1.5", chat(max_tokens=1.5), BAD, IP, "max_tokens"),
    Case("stop an int", chat(stop=5), BAD, IP, "stop"),
    Case("stop with an empty string", chat(stop=["a", ""]), BAD, IP, "stop[1]"),
    Case(
        "content a dict",
        {"messages": [{"role": "user", "content": {"a": 1}}]},
        BAD,
        IP,
        "messages[0].content",
    ),
    Case(
        "text part text an int",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        BAD,
        IP,
        "messages[0].content[0].text",
    ),
    Case("role missing", {"messages": [{"content": "x"}]}, BAD, IP, "messages[0].role"),
    Case("messages empty", {"messages": []}, BAD, IP, "messages"),
    # structured output
    Case("response_format json_object", chat(response_format={"type": "json_object"}), 200),
    Case(
        "response_format json_schema",
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["a"]}}}
        ),
        200,
    ),
    Case(
        "response_format type yaml", chat(response_format={"type": "yaml"}), BAD, IP, "response_format.type"
    ),
    Case("response_format a string", chat(response_format="json"), BAD, IP, "response_format"),
    Case("json_schema missing", chat(response_format={"type": "json_schema"}), BAD, IP, "response_format"),
    Case(
        "schema not an object",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": True}}),
        BAD,
        IP,
        "response_format.json_schema.schema",
    ),
    Case(
        "schema with a bad $ref",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}),
        BAD,
        IP,
        "response_format",
    ),
    Case(
        "schema type 5",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
        BAD,
        IP,
        "response_format",
    ),
    Case(
        "schema minimum > maximum",
        text(json_schema={"type": "integer", "minimum": 3, "maximum": 1}),
        BAD,
        IP,
        "json_schema",
        TEXT,
    ),
    Case("grammar that does not parse", text(grammar="root ::= ("), BAD, IP, "grammar", TEXT),
    Case("grammar and json_schema", text(grammar='root ::= "a"', json_schema={}), BAD, IP, "grammar", TEXT),
    Case("grammar streamed", text(grammar='root ::= "a"', stream=True), 200, path=TEXT),
    # grammars that once crashed or stalled the server: bounded before llguidance, compiled on a thread
    # with a large stack; what fails is a 400 naming the field
    Case(
        "schema: 85 KB $ref chain",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": CHAIN}}),
        BAD,
        IP,
        "response_format",
    ),
    Case("json_schema: 85 KB $ref chain", text(json_schema=CHAIN), BAD, IP, "json_schema", TEXT),
    Case(
        "tool parameters: 85 KB $ref chain",
        chat(tools=[fn(parameters=CHAIN)], tool_choice="required"),
        BAD,
        IP,
        "tools[0].function.parameters",
    ),
    Case(
        "schema: $ref chain past the depth bound",
        text(json_schema=ref_chain(200, objects=True)),
        BAD,
        IP,
        "json_schema",
        TEXT,
    ),
    Case(
        "schema: $ref to a remote document",
        text(json_schema={"$ref": "https://x.test/s.json"}),
        BAD,
        IP,
        "json_schema",
        TEXT,
    ),
    Case(
        "schema: a $ref cycle (no output possible)", text(json_schema=SELF_REF), BAD, IP, "json_schema", TEXT
    ),
    Case("grammar: 4,000-rule chain", text(grammar=gbnf_chain(4000)), BAD, IP, "grammar", TEXT),
    Case("grammar: 1,000-rule chain (the bound)", text(grammar=gbnf_chain(1000)), 200, path=TEXT),
    Case(
        "grammar: 70,000 characters",
        text(grammar='root ::= "' + "a" * 70_000 + '"'),
        BAD,
        IP,
        "grammar",
        TEXT,
    ),
    Case("completions logprobs 21", text(logprobs=21), BAD, IP, "logprobs", TEXT),
    Case("prompt batch", text(prompt=["a", "b"]), BAD, IP, "prompt", TEXT),
    Case("10k-level nesting", nested(10_000), BAD, "invalid_json"),
    Case("a 4,400-digit integer", raw(HI_JSON + '"max_tokens": ' + "9" * 4400 + "}"), BAD, "invalid_json"),
    Case("65 levels in an ignored field", chat(x=deep(64)), BAD, "invalid_json"),
    Case("64 levels in an ignored field", chat(x=deep(63)), 200),
    Case("10k-level nesting, top level", b"[" * 10_000 + b"]" * 10_000, BAD, "invalid_json"),
    Case("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', BAD, "invalid_json"),
    Case("truncated JSON", b'{"messages": [', BAD, "invalid_json"),
    Case("empty body", b"", BAD, "invalid_json"),
    Case("body a list", b"[]", BAD, IP),
    Case("body null", b"null", BAD, IP),
    Case(
        "Content-Type text/plain",
        chat(),
        415,
        "unsupported_content_type",
        headers={"Content-Type": "text/plain"},
    ),
    # no Content-Type at all: JSON, as Ollama reads it, unless a browser sent it (a "simple" request)
    Case("no Content-Type", chat(), 200, headers={}),
    Case(
        "no Content-Type, from a page",
        chat(),
        415,
        "unsupported_content_type",
        headers={"Origin": "http://evil.example"},
    ),
    Case(
        "no Content-Type, a browser's fetch metadata",
        chat(),
        415,
        "unsupported_content_type",
        headers={"Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Site": "cross-site"},
    ),
    Case("no Content-Type, not JSON", b"messages=hi", BAD, "invalid_json", headers={}),
    Case(
        "Content-Type form",
        chat(),
        415,
        "unsupported_content_type",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    ),
    Case(
        "Content-Type json with charset",
        chat(),
        200,
        headers={"Content-Type": "application/json; charset=utf-8"},
    ),
    Case(
        "2 MB body", chat(messages=[{"role": "user", "content": "x" * 2_000_000}]), 413, "request_too_large"
    ),
    Case(
        "prompt beyond the context",
        chat(messages=[{"role": "user", "content": "word " * 2000}]),
        BAD,
        "context_length_exceeded",
    ),
    # text that is fine
    Case("NUL bytes", chat(messages=[{"role": "user", "content": "a\x00b\x00"}]), 200),
    Case("NUL in the model name", chat(model="a\x00b"), 404, "model_not_found", "model"),
    Case("CJK", chat(messages=[{"role": "user", "content": "你好，世界。日本語のテキスト"}]), 200),
    Case("emoji", chat(messages=[{"role": "user", "content": "🙂👍🏽🇫🇷 family: 👨‍👩‍👧"}]), 200),
    Case(
        "right-to-left and combining", chat(messages=[{"role": "user", "content": "\u202eabc e\u0301"}]), 200
    ),
    Case("model ../../etc/passwd", chat(model="../../etc/passwd"), 404, "model_not_found", "model"),
    # paths, hosts, origins
    Case("static ../ traversal", None, 404, "not_found", path="/static/../../etc/passwd", method="GET"),
    Case(
        "static %2e%2e traversal",
        None,
        404,
        "not_found",
        path="/static/%2e%2e/%2e%2e/etc/passwd",
        method="GET",
    ),
    Case(
        "static %2f traversal", None, 404, "not_found", path="/static/..%2f..%2fserver%2fapp.py", method="GET"
    ),
    Case("static absolute path", None, 404, "not_found", path="/static//etc/passwd", method="GET"),
    Case("unknown path", None, 404, "not_found", path="/v1/nothing", method="GET"),
    Case("wrong method", None, 405, "method_not_allowed", path="/v1/models", method="DELETE"),
    Case("foreign Host", chat(), 403, "host_not_allowed", headers={**JSON, "Host": "evil.example"}),
    Case(
        "foreign Host on GET",
        None,
        403,
        "host_not_allowed",
        path="/v1/models",
        method="GET",
        headers={"Host": "attacker.test:8000"},
    ),
    Case(
        "CORS preflight from a foreign origin",
        None,
        403,
        "cors_not_allowed",
        method="OPTIONS",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    ),
    Case(
        "CORS preflight from the configured origin",
        None,
        200,
        method="OPTIONS",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
        allow_origin="http://localhost:3000",
    ),
    Case(
        "CORS request from a foreign origin", chat(), 200, headers={**JSON, "Origin": "http://evil.example"}
    ),
    # the Responses API and llama.cpp's tokenizer endpoints (OpenAI's error shape)
    Case("responses: surrogate in input", raw('{"input": "a\\ud800"}'), BAD, IP, "input", RESP),
    Case(
        "responses: surrogate in an item",
        raw('{"input": [{"role": "user", "content": [{"type": "input_text", "text": "\\udc00"}]}]}'),
        BAD,
        IP,
        "input[0].content[0].text",
        RESP,
    ),
    Case(
        "responses: previous_response_id",
        resp(previous_response_id="resp_x"),
        BAD,
        IP,
        "previous_response_id",
        RESP,
    ),
    Case("responses: max_output_tokens '5'", resp(max_output_tokens="5"), BAD, IP, "max_output_tokens", RESP),
    Case(
        "responses: temperature NaN", raw('{"input": "hi", "temperature": NaN}'), BAD, IP, "temperature", RESP
    ),
    Case("responses: input a number", resp(input=5), BAD, IP, "input", RESP),
    Case("responses: item not an object", resp(input=["hi"]), BAD, IP, "input[0]", RESP),
    Case("responses: 65-level input", resp(input=deep(64)), BAD, "invalid_json", path=RESP),
    Case(
        "responses: input beyond the context",
        resp(input="word " * 2000),
        BAD,
        "context_length_exceeded",
        path=RESP,
    ),
    Case("responses: truncation auto", resp(input="word " * 2000, truncation="auto"), 200, path=RESP),
    Case("responses: emoji", resp(input="🙂👍🏽🇫🇷"), 200, path=RESP),
    Case("responses: max_output_tokens 10**30", resp(max_output_tokens=10**30), 200, path=RESP),
    # structured output and function tools
    Case(
        "responses: text.format json_object", resp(text={"format": {"type": "json_object"}}), 200, path=RESP
    ),
    Case(
        "responses: text.format json_schema",
        resp(text={"format": {"type": "json_schema", "name": "n", "schema": {"enum": ["a"]}}}),
        200,
        path=RESP,
    ),
    Case(
        "responses: text.format unsupported",
        resp(text={"format": {"type": "json_schema", "schema": {"not": {}}}}),
        BAD,
        IP,
        "text.format",
        RESP,
    ),
    Case("responses: text.format a string", resp(text={"format": "json"}), BAD, IP, "text.format", RESP),
    Case(
        "responses: text.format 85 KB $ref chain",
        resp(text={"format": {"type": "json_schema", "name": "x", "schema": CHAIN}}),
        BAD,
        IP,
        "text.format",
        RESP,
    ),
    Case("responses: hosted tool", resp(tools=[{"type": "web_search"}]), BAD, IP, "tools[0].type", RESP),
    Case(
        "responses: function tool, choice none",
        resp(tools=[{"type": "function", "name": "f"}], tool_choice="none"),
        200,
        path=RESP,
    ),
    Case(
        "responses: tool parameters unsupported",
        resp(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "not": {}}}]),
        BAD,
        IP,
        "tools[0].parameters",
        RESP,
    ),
    Case(
        "responses: function call and its output",
        resp(
            input=[
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "2"},
            ]
        ),
        200,
        path=RESP,
    ),
    Case(
        "responses: function call arguments an object",
        resp(input=[{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {}}]),
        BAD,
        IP,
        "input[0].arguments",
        RESP,
    ),
    Case("tokenize: surrogate", raw('{"content": "\\ud800"}'), BAD, IP, "content", "/tokenize"),
    Case("tokenize: content a dict", {"content": {"a": 1}}, BAD, IP, "content", "/tokenize"),
    Case("tokenize: negative id", {"content": ["a", -1]}, BAD, IP, "content[1]", "/tokenize"),
    Case("tokenize: NUL and emoji", {"content": "a\x00🙂", "with_pieces": True}, 200, path="/tokenize"),
    Case("tokenize: 100k characters", {"content": "ab" * 50_000}, 200, path="/tokenize"),
    Case("detokenize: id 10**30", {"tokens": [1, 10**30]}, BAD, IP, "tokens[1]", "/detokenize"),
    Case(
        "detokenize: id 2**64 as a float",
        raw('{"tokens": [1.8446744073709552e19]}'),
        BAD,
        IP,
        "tokens[0]",
        "/detokenize",
    ),
    Case("detokenize: a string", {"tokens": ["1"]}, BAD, IP, "tokens[0]", "/detokenize"),
    Case(
        "apply-template: role missing",
        {"messages": [{"content": "x"}]},
        BAD,
        IP,
        "messages[0].role",
        "/apply-template",
    ),
    # Counts past the documented limits are refused before anything validates them: 150,000 bad items held
    # the event loop for seconds while pydantic built an error for each
    Case("detokenize: 150k bad ids", {"tokens": [-1] * 150_000}, BAD, IP, "tokens", "/detokenize"),
    Case("tokenize: 150k ids", {"content": [1] * 150_000}, BAD, IP, "content", "/tokenize"),
    # within the count, every id bad: one error at the first (pydantic made 131,072 of them, seconds)
    Case("detokenize: 131,072 bad ids", {"tokens": [-1] * 131_072}, BAD, IP, "tokens[0]", "/detokenize"),
    Case(
        "tokenize: 131,072 bad ids", {"content": ["a", *[-1] * 131_071]}, BAD, IP, "content[1]", "/tokenize"
    ),
    Case(
        "completions: 131,072 prompt ids",
        text(prompt=[1] * 131_072),
        BAD,
        "context_length_exceeded",
        "prompt",
        TEXT,
    ),
    Case(
        "completions: prompt ids past the vocabulary", text(prompt=[1, 2**31 - 1]), BAD, IP, "prompt[1]", TEXT
    ),
    Case("completions: a negative prompt id", text(prompt=[1, -1]), BAD, IP, "prompt[1]", TEXT),
    Case("completions: two prompts of ids", text(prompt=[[1], [2]]), BAD, IP, "prompt", TEXT),
    Case("completions: prompt ids", text(prompt=[1, 2, 3]), 200, path=TEXT),
    Case("completions: 150k prompt ids", text(prompt=[-1] * 150_000), BAD, IP, "prompt", TEXT),
    Case("chat: 100k stop ints", chat(stop=[1] * 100_000), BAD, IP, "stop"),
    Case("chat: 65 stop strings", chat(stop=["x"] * 65), BAD, IP, "stop"),
    Case("chat: 64 stop strings", chat(stop=["x"] * 64), 200),
    Case("chat: 60k bad messages", {"messages": [{"role": "x"}] * 60_000}, BAD, IP, "messages"),
    Case("chat: 2049 messages", {"messages": HI * 2049, "max_tokens": 1}, BAD, IP, "messages"),
    Case(
        "chat: 60k out-of-range logit_bias",
        chat(logit_bias={str(i): 1000 for i in range(60_000)}),
        BAD,
        IP,
        "logit_bias",
    ),
    Case(
        "chat: 129 tools",
        chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
        BAD,
        IP,
        "tools",
    ),
    Case(
        "chat: 257 content parts",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
        BAD,
        IP,
        "messages[0].content",
    ),
    Case("chat: 160k ignored lists", chat(junk=[[0]] * 160_000), 200),
    # within the schema caps, but past what the grammar engine's parser holds at the first property name:
    # refused before the reply, not 3 s into it
    Case(
        "chat: a schema of 1,998 string properties",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "wide",
                    "schema": {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "string"} for i in range(1998)},
                    },
                },
            }
        ),
        BAD,
        IP,
        "response_format",
    ),
    Case("responses: 2049 input items", resp(input=["hi"] * 2049), BAD, IP, "input", RESP),
    Case(
        "apply-template: model elsewhere",
        {"messages": HI, "model": "x"},
        404,
        "model_not_found",
        "model",
        "/apply-template",
    ),
    # embeddings: each refused while the body is validated, before a model is looked up or the worker
    # asked (this server has no embedding model: a request that got that far would be wrong_model_kind)
    Case("embeddings: empty input", emb(input=[]), BAD, IP, "input", EMB),
    Case("embeddings: empty string", emb(input=""), BAD, IP, "input", EMB),
    Case("embeddings: 100,000 inputs", emb(input=["a"] * 100_000), BAD, IP, "input", EMB),
    Case("embeddings: 100,000 rows of ids", emb(input=[[1]] * 100_000), BAD, IP, "input", EMB),
    Case("embeddings: a 1 MB input", emb(input="word " * 200_000), 413, "request_too_large", path=EMB),
    Case("embeddings: a negative token id", emb(input=[1, -1]), BAD, IP, "input[1]", EMB),
    Case("embeddings: a token id past int32", emb(input=[[1, 2**31]]), BAD, IP, "input[0][1]", EMB),
    Case("embeddings: dimensions 0", emb(dimensions=0), BAD, IP, "dimensions", EMB),
    Case("embeddings: dimensions 10**30", emb(dimensions=10**30), BAD, IP, "dimensions", EMB),
    Case("embeddings: encoding_format int8", emb(encoding_format="int8"), BAD, IP, "encoding_format", EMB),
    Case("embedding: 100,000 contents", {"content": ["a"] * 100_000}, BAD, IP, "content", "/embedding"),
    Case("embedding: no content", {"model": "x"}, BAD, IP, "content", "/embedding"),
    Case("embedding: 150k ids", {"content": [1] * 150_000}, BAD, IP, "content", "/embedding"),
    Case(
        "embedding: embd_normalize -2",
        {"content": "a", "embd_normalize": -2},
        BAD,
        IP,
        "embd_normalize",
        "/embedding",
    ),
]
