"""What the JSON grammar lets a number, a string and whitespace grow to (models/runtime/json_bounds.py).

Each case walks llguidance's matcher over a byte-level vocabulary (one token per byte): after a prefix, how
many times may one byte follow? Unbounded, that is as many as we try (the digits a small model wrote until
max_tokens ran out); bounded, it stops where a 64-bit integer, a fixed-point double or a string of
MAX_STRING_CHARS ends, and the value can still close."""

from __future__ import annotations

import copy
import json

import llguidance as llg
import numpy as np
import pytest

from models.runtime.constraint import JSON_LAYOUT, LIMITS, _byte_vocabulary, json_lark, json_schema_grammar
from models.runtime.json_bounds import INT_BOUND, MAX_STRING_CHARS, NUMBER_DECIMALS, bound_schema

CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
TRIES = MAX_STRING_CHARS + 10


def allowed(matcher) -> set[int]:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    return {i for i in range(257) if bits[i]}


def run_of(grammar: str, prefix: str, byte: str, tries: int = 64) -> tuple[int, set[int]]:
    """How many `byte`s may follow `prefix` (up to `tries`), and what may follow them."""
    m = llg.LLMatcher(_byte_vocabulary(), grammar, log_level=0, limits=LIMITS)
    for b in prefix.encode():
        assert b in allowed(m), (prefix, chr(b))
        assert m.consume_token(b)
    n = 0
    while n < tries and ord(byte) in allowed(m):
        assert m.consume_token(ord(byte))
        n += 1
    assert not m.is_error(), m.get_error()
    return n, allowed(m)


def unbounded(schema: dict) -> str:
    return llg.LLMatcher.grammar_from_json_schema(json.dumps({**schema, "x-guidance": JSON_LAYOUT}))


def test_bounds_when_integer_then_at_most_int64_digits_and_it_can_close() -> None:
    prefix = '{"name": "Oslo", "population": '
    assert run_of(unbounded(CITY), prefix, "9")[0] == 64  # the peer: as many digits as we try
    n, after = run_of(json_schema_grammar(CITY), prefix, "9")
    assert n == len(str(INT_BOUND)) - 1  # 18 nines; 19 digits up to 9.22e18
    assert ord("}") in after and not {ord(d) for d in "0123456789"} & after
    assert run_of(json_schema_grammar(CITY), prefix + "-", "1")[0] == len(str(INT_BOUND))


def test_bounds_when_number_then_fixed_point_with_bounded_decimals() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    assert run_of(unbounded(schema), '{"x": 1.', "3")[0] == 64
    assert run_of(json_schema_grammar(schema), '{"x": 1.', "3")[0] == NUMBER_DECIMALS
    assert run_of(json_schema_grammar(schema), '{"x": ', "9")[0] == len(str(INT_BOUND)) - 1


def test_bounds_when_string_without_max_length_then_it_ends() -> None:
    prefix = '{"name": "'
    assert run_of(unbounded(CITY), prefix, "a", TRIES)[0] == TRIES
    n, after = run_of(json_schema_grammar(CITY), prefix, "a", TRIES)
    assert n == MAX_STRING_CHARS and after == {ord('"')}


def test_bounds_when_whitespace_then_none_is_allowed() -> None:
    n, _ = run_of(json_schema_grammar(CITY), "{", " ")
    assert n == 0


@pytest.mark.parametrize(
    "schema, prefix",
    [
        (None, '{"a": '),  # json_object mode
        ({"description": "anything"}, "["),  # any JSON value
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
            '{"a": "b", "c": [{"d": ',
        ),
        ({"type": "array"}, "[1, "),  # items left open
        ({"type": "object", "additionalProperties": True}, '{"z": '),
    ],
    ids=["json_object", "open schema", "additional property", "open items", "additionalProperties true"],
)
def test_bounds_when_a_value_is_left_open_then_its_numbers_are_bounded_too(schema, prefix) -> None:
    assert run_of(json_schema_grammar(schema), prefix, "9")[0] == len(str(INT_BOUND)) - 1


def test_bounds_when_an_object_names_its_properties_then_no_others_unless_allowed() -> None:
    """The key after the last named one: none may follow (a small model went on inventing keys until
    max_tokens); with additionalProperties true, or a required name not among them, they may."""
    prefix = '{"name": "Oslo", "population": 5'
    assert ord(",") in run_of(unbounded(CITY), prefix, "0")[1]
    assert ord(",") not in run_of(json_schema_grammar(CITY), prefix, "0")[1]
    open_city = {**CITY, "additionalProperties": True}
    assert ord(",") in run_of(json_schema_grammar(open_city), prefix, "0")[1]
    unnamed = {**CITY, "required": ["name", "population", "country"]}
    assert bound_schema(unnamed)["additionalProperties"] == {"$ref": "#/$defs/simmer-any"}


def test_bounds_when_the_schema_gives_bounds_then_they_are_kept() -> None:
    schema = {"type": "integer", "minimum": 0, "maximum": 500}
    assert run_of(json_schema_grammar(schema), "", "4")[0] == 3
    assert run_of(json_schema_grammar(schema), "", "-")[0] == 0  # minimum 0: no sign
    n, _ = run_of(json_schema_grammar({"type": "integer", "maximum": 10**40}), "", "9")
    assert n == len(str(INT_BOUND)) - 1  # clamped to int64
    decimals = {"type": "number", "multipleOf": 0.25, "minimum": 0}
    assert run_of(json_schema_grammar(decimals), "1.", "2")[0] == 1  # 1.25 at most: the schema's own


def test_bounds_when_enum_or_const_then_untouched() -> None:
    assert bound_schema({"enum": [2**80]})["enum"] == [2**80]
    assert "maxLength" not in bound_schema({"type": "string", "const": "x" * 5000})


def test_bounds_when_rewritten_then_the_request_schema_is_not_changed() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "number", "minimum": 1}},
    }
    before = copy.deepcopy(schema)
    bound_schema(schema)
    json_schema_grammar(schema)
    assert schema == before


def test_bounds_when_tool_arguments_then_bounded_as_well() -> None:
    lark = llg.LLMatcher.grammar_from_lark("start: " + json_lark(CITY))
    assert run_of(lark, '{"name": "x", "population": ', "9")[0] == len(str(INT_BOUND)) - 1


def test_bounds_when_inside_all_of_then_still_bounded_and_valid() -> None:
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}
    assert run_of(json_schema_grammar(schema), '{"a": ', "9")[0] == len(str(INT_BOUND)) - 1
