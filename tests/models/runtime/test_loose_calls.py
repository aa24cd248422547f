"""Tool calls written the model's own way under `tool_choice: "auto"`: the recogniser (LooseScan, parse),
the reader holding back what could become a call, and the engine with a scripted forward pass (the real
grammar, sampler, detokenizer and reader), as Qwen2.5-Coder wrote them."""

from __future__ import annotations

import json

import pytest

from models.runtime.loose_calls import LooseScan, parse, schema_order, valid
from models.runtime.tools import FORMATS, CallReader
from models.types import GenerationParams, SamplingParams, Tool, ToolCallDelta, ToolUse
from tests.models.runtime.helpers import run
from tests.scripted_session import scripted_engine

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
)
TIME = Tool("get_time", None, None)  # no schema: any object
TOOLS = (WEATHER, TIME)

QWEN_15B = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
QWEN_05B = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def scan(text: str, *, markup: bool = True, parallel: bool = True) -> LooseScan:
    s = LooseScan(TOOLS, markup=markup, parallel=parallel)
    s.feed(text)
    return s


@pytest.mark.parametrize(
    "text, calls",
    [
        (QWEN_15B, [("get_weather", '{"city": "Paris"}')]),
        (QWEN_05B, [("get_weather", '{"city": "Paris"}')]),
        ("\n  " + QWEN_05B + "\n", [("get_weather", '{"city": "Paris"}')]),
        ('```\n{"name": "get_time"}\n```', [("get_time", "{}")]),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", '{"city": "Oslo"}')]),
        (
            '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
            [("get_weather", '{"city": "Oslo"}')],
        ),
        # keys in any order; arguments delivered in the schema's order, canonical layout
        (
            '{"arguments":{"unit":"celsius","city":"Oslo"},"name":"get_weather"}',
            [("get_weather", '{"city": "Oslo", "unit": "celsius"}')],
        ),
        ('{"name": "get_weather", "arguments": {"city": "北京"}}', [("get_weather", '{"city": "北京"}')]),
        (
            '<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a"}}\n</tool_call>\n',
            [("get_time", "{}"), ("get_weather", '{"city": "a"}')],
        ),
    ],
)
def test_parse_when_one_call_written_loosely_then_that_call(text, calls):
    s = scan(text)
    assert s.viable and s.complete
    assert [(c.name, c.arguments) for c in parse(s, TOOLS) or []] == calls


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        'Sure! {"name": "get_time"}',  # prose first
        QWEN_05B + " Done.",  # prose after
        QWEN_05B + "\n" + QWEN_05B,  # two objects, not in the markup
        '{"name": "Paris", "population": 2100000}',  # a JSON answer, not a declared function
        '{"name": "get_weather", "city": "Paris"}',  # another key
        '{"name": "get_weather", "arguments": {"city": "X"}, "arguments": {}}',  # a key twice
        '{"name": "get_weather", "arguments": {"city": "X"}, "parameters": {}}',
        '{"arguments": {"city": "X"}}',  # no name
        '{"name": "get_weather", "arguments": [1]}',
        '{"name": "get_weather", "arguments": NaN}',
        '{"name": "get_weather", "arguments": {"city": "X"}',  # cut
        "```python\nprint(1)\n```",
        '```json\n{"name": "get_time"}\n``` and more',
        "{}",
        '[{"name": "get_time"}]',
        '<tool_call>{"name": "get_time"}</tool_call> ok',
    ],
)
def test_parse_when_not_exactly_one_call_then_text(text):
    assert parse(scan(text), TOOLS) is None


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"unit": "kelvin", "city": "X"}}',  # enum
        '{"name": "get_weather", "arguments": {"unit": "celsius"}}',  # required
        '{"name": "get_weather", "arguments": {"city": 5}}',  # type
    ],
)
def test_parse_when_arguments_fail_the_schema_then_text(text):
    s = scan(text)
    assert s.complete and parse(s, TOOLS) is None


@pytest.mark.parametrize(
    "prefix, viable",
    [
        ("", True),
        ("  \n", True),
        ("```", True),
        ("```js", True),  # maybe "json" still
        ("```jsonx\n", False),
        ("``` and", False),
        ('{"na', True),
        ('{"nam3', False),  # no top-level key begins so
        ('{"name": "get_w', True),
        ('{"name": "Par', False),  # no declared function begins so
        ('{"name": 5', False),
        ('{"name": "get_time"} x', False),
        ("<tool_c", True),
        ("<b>", False),
        ("Hello", False),
    ],
)
def test_scan_when_prefix_then_viable_only_while_it_can_still_be_a_call(prefix, viable):
    assert scan(prefix).viable is viable


def test_scan_when_not_parallel_then_one_markup_call_only():
    one = '<tool_call>{"name": "get_time"}</tool_call>'
    assert parse(scan(one + one, parallel=False), TOOLS) is None
    assert parse(scan(one, parallel=False), TOOLS) is not None


def test_scan_when_markup_is_not_the_template_s_then_text():
    assert parse(scan('<tool_call>{"name": "get_time"}</tool_call>', markup=False), TOOLS) is None


def test_schema_order_follows_properties_refs_and_branches():
    schema = {
        "type": "object",
        "properties": {"b": {"$ref": "#/$defs/inner"}, "a": {"type": "integer"}},
        "$defs": {"inner": {"anyOf": [{"properties": {"y": {}, "x": {}}}, {"type": "null"}]}},
    }
    value = {"extra": 1, "a": 2, "b": {"x": 1, "z": 0, "y": 2}}
    assert list(schema_order(value, schema)) == ["b", "a", "extra"]
    assert list(schema_order(value, schema)["b"]) == ["y", "x", "z"]


def test_valid_when_pattern_would_backtrack_then_answers_at_once():
    # a client's regex runs in llguidance's linear-time engine, never Python's backtracking one (4,000
    # characters: within the bound on a string without maxLength)
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}
    assert valid(json.dumps({"s": "a" * 4000}), schema)
    assert not valid(json.dumps({"s": "a" * 4000 + "!"}), schema)


# ---- the reader: what is held back while streaming -------------------------------------------------


def read(text: str, piece: int, *, complete: bool = True, use: ToolUse | None = None):
    reader = CallReader(FORMATS["hermes"], use or ToolUse(TOOLS, choice="auto"))
    shown: list[str] = []
    deltas: list[ToolCallDelta] = []
    for i in range(0, len(text), piece):
        c, d = reader.feed(text[i : i + piece])
        shown.append(c)
        deltas += d
    c, d = reader.flush(complete=complete)
    return shown, c, deltas + d, reader


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_reader_when_a_loose_call_streams_then_nothing_shown_and_one_call_at_the_end(piece):
    shown, tail, deltas, reader = read(QWEN_15B, piece)
    assert "".join(shown) == "" and tail == ""
    assert reader.calls == 1
    first, then = deltas  # as a stream has them: the name, then the arguments
    assert first.index == 0 and first.name == "get_weather" and first.id and first.id.startswith("call_")
    assert first.arguments == "" and (then.index, then.id, then.name) == (0, None, None)
    assert then.arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_reader_when_prose_then_shown_as_it_comes(piece):
    text = "It is sunny in Paris today, 21 degrees."
    shown, tail, deltas, _ = read(text, piece)
    assert deltas == [] and "".join(shown) + tail == text
    if piece == 1:
        assert shown[0] == "I"  # not held: prose cannot be a call


def test_reader_when_json_answer_then_released_once_it_cannot_be_a_call():
    text = '{"name": "Paris", "population": 2100000}'
    shown, tail, deltas, _ = read(text, 1)
    assert deltas == [] and "".join(shown) + tail == text
    released = next(i for i, s in enumerate(shown) if s)
    assert text[: released + 1] == '{"name": "P'  # at the first letter no declared name begins with


def test_reader_when_cut_by_length_then_text_even_if_whole():
    shown, tail, deltas, reader = read(QWEN_05B, 5, complete=False)
    assert deltas == [] and reader.calls == 0 and "".join(shown) + tail == QWEN_05B


@pytest.mark.parametrize("choice", ["none", "required", "get_weather"])
def test_reader_when_not_auto_then_no_loose_calls(choice):
    shown, tail, deltas, _ = read(QWEN_05B, 1000, use=ToolUse(TOOLS, choice=choice))
    assert deltas == [] and "".join(shown) + tail == QWEN_05B


# ---- the engine, its forward pass scripted as the real models wrote ----------------------------------


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir


def generate(folder, reply: str, choice: str = "auto", max_tokens: int = 120, template: str | None = None):
    engine = scripted_engine(folder, reply, context_length=256, chat_template=template)
    params = GenerationParams(
        SamplingParams(temperature=0.0), max_tokens=max_tokens, tools=ToolUse(TOOLS, choice=choice)
    )
    return run(engine, engine.text_prompt("call"), params)


def calls_of(tokens, fin) -> list[tuple[str, str]]:
    deltas = [d for t in tokens for d in t.tool_calls] + list(fin.tool_calls)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        name, args = calls.get(d.index, ["", ""])
        calls[d.index] = [name or d.name or "", args + d.arguments]
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("reply", [QWEN_15B, QWEN_05B])
def test_engine_when_auto_and_model_writes_its_own_call_then_tool_calls(folder, reply):
    tokens, fin = generate(folder, reply)
    assert fin.finish_reason == "tool_calls"
    assert calls_of(tokens, fin) == [("get_weather", '{"city": "Paris"}')]
    assert "".join(t.text for t in tokens) + fin.text == ""


def test_engine_when_qwen_template_and_hermes_markup_loosely_then_calls(folder):
    from tests.chat_templates import QWEN25

    reply = '<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>'
    tokens, fin = generate(folder, reply, template=QWEN25)
    assert fin.finish_reason == "tool_calls"
    assert calls_of(tokens, fin) == [("get_time", '{"zone": "UTC"}')]


@pytest.mark.parametrize(
    "reply", ["Paris is mild today.", '{"name": "Paris", "country": "France"}', QWEN_05B + " Anything else?"]
)
def test_engine_when_auto_and_text_then_text_whole_and_no_call(folder, reply):
    tokens, fin = generate(folder, reply)
    assert fin.finish_reason == "stop" and calls_of(tokens, fin) == []
    assert "".join(t.text for t in tokens) + fin.text == reply


def test_engine_when_a_loose_call_is_cut_by_max_tokens_then_text_and_length(folder):
    tokens, fin = generate(folder, QWEN_05B, max_tokens=6)
    assert fin.finish_reason == "length" and calls_of(tokens, fin) == []
    assert QWEN_05B.startswith("".join(t.text for t in tokens) + fin.text)


# ---- what a hostile request or a runaway model may bring ----------------------------------------------


def test_schema_order_when_schema_refers_to_itself_from_many_branches_then_linear():
    schema = {"anyOf": [{"$ref": "#"} for _ in range(8)] + [{"properties": {"b": {}, "a": {"$ref": "#"}}}]}
    value = {"a": {"a": {"a": {}, "b": 1}, "b": 2}, "b": 3}
    assert json.dumps(schema_order(value, schema)) == '{"b": 3, "a": {"b": 2, "a": {"b": 1, "a": {}}}}'


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_time", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}",  # deeper than json goes
        '{"name": "get_time", "arguments": {"x": "\\ud800"}}',  # a lone surrogate
        '{"name": "get_time", "arguments": {"x": 1e400}}',  # not a finite number
    ],
)
def test_parse_when_arguments_cannot_be_vouched_for_then_text_not_an_error(text):
    s = scan(text)
    assert s.complete and parse(s, TOOLS) is None
