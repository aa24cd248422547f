"""The size and depth bounds a JSON schema meets before llguidance compiles it (schema_limits.py).

The crash itself (a `$ref` chain deep enough to overflow the native stack) is reproduced in a subprocess by
tests/server/http/test_grammar_crash.py; here, what is refused and what is not, and that the bound holds
for any order the compiler might visit definitions in."""

from __future__ import annotations

import json

import pytest

from models.errors import InvalidParameter
from models.runtime.constraint import check_grammar, json_schema_grammar
from models.runtime.schema_limits import MAX_DEPTH, MAX_NODES, check_schema_limits


def ref_chain(n: int, kind: str = "anyOf") -> dict:
    """`n` definitions, each referring to the next (the shape of the 85 KB request that crashed the
    server)."""
    if kind == "anyOf":
        defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(n)}
    else:
        defs = {
            f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
        }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_limits_when_the_crashing_chain_then_refused_before_llguidance() -> None:
    schema = ref_chain(1300)
    assert 80_000 < len(json.dumps(schema)) < 90_000  # the size of the request that killed the server
    with pytest.raises(InvalidParameter) as err:
        json_schema_grammar(schema)
    assert err.value.param == "response_format" and "too large" in err.value.message


def test_limits_when_a_chain_deeper_than_the_bound_then_refused_naming_the_depth() -> None:
    # 200 definitions of 2 objects each: under MAX_NODES, over MAX_DEPTH
    with pytest.raises(InvalidParameter) as err:
        check_schema_limits(ref_chain(200, "object"), "json_schema")
    assert err.value.param == "json_schema" and "nests too deep" in err.value.message
    assert f"at most {MAX_DEPTH}" in err.value.message


def test_limits_when_a_chain_within_the_bound_then_it_compiles() -> None:
    schema = ref_chain(MAX_DEPTH // 2 - 2, "object")
    check_schema_limits(schema, "x")
    check_grammar(json_schema_grammar(schema), "x")


def test_limits_when_mutual_recursion_then_bounded_by_the_whole_cycle() -> None:
    """Definitions that refer to each other in a ring: a compiler may walk the ring from any member, so
    the bound counts every member once, whatever the order (a ring of MAX_DEPTH is refused)."""

    def ring(n: int) -> dict:
        defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{(i + 1) % n}"}, {"type": "null"}]} for i in range(n)}
        return {"$ref": "#/$defs/d0", "$defs": defs}

    check_schema_limits(ring(MAX_DEPTH // 2 - 1), "x")  # 2 objects per member, + the root
    with pytest.raises(InvalidParameter, match="nests too deep"):
        check_schema_limits(ring(MAX_DEPTH // 2 + 1), "x")


def test_limits_when_ordinary_recursive_schema_then_accepted() -> None:
    tree = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["name"],
            }
        },
    }
    check_schema_limits(tree, "x")
    check_grammar(json_schema_grammar(tree), "x")


def test_limits_when_too_many_schema_objects_then_refused() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_NODES)}}
    with pytest.raises(InvalidParameter, match=f"over {MAX_NODES} schema objects"):
        check_schema_limits(wide, "x")
    wide["properties"].popitem()
    check_schema_limits(wide, "x")


@pytest.mark.parametrize(
    "ref",
    ["http://example.com/s.json", "other.json#/a", "#anchor", "s.json"],
    ids=["url", "file", "anchor", "rel"],
)
def test_limits_when_ref_leaves_the_document_then_refused(ref: str) -> None:
    """A reference the walk cannot follow could hide a chain from the bound."""
    with pytest.raises(InvalidParameter, match=r"\$ref must"):
        check_schema_limits({"type": "object", "properties": {"a": {"$ref": ref}}}, "x")


def test_limits_when_ref_inside_a_nested_id_then_resolved_against_that_resource() -> None:
    """`#/...` inside a subschema with its own `$id` names that subschema's definitions (JSON Schema):
    the walk follows the chain there, so it cannot be hidden behind an `$id`."""
    inner_defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(200)}
    inner_defs["d200"] = {"type": "string"}
    schema = {
        "$id": "https://x/root",
        "$ref": "#/$defs/inner",
        "$defs": {"inner": {"$id": "https://x/inner", "$ref": "#/$defs/d0", "$defs": inner_defs}},
    }
    with pytest.raises(InvalidParameter, match="nests too deep"):
        check_schema_limits(schema, "x")


def test_limits_when_ref_points_nowhere_then_left_to_llguidance() -> None:
    check_schema_limits({"$ref": "#/nowhere"}, "x")  # nothing to follow, nothing to bound
    with pytest.raises(InvalidParameter, match="does not exist"):
        check_grammar(json_schema_grammar({"$ref": "#/nowhere"}), "x")
