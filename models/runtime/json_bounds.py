"""Finite JSON lexemes: what a schema leaves unbounded gets a bound before llguidance compiles it.

A small model sampling under a grammar that allows it can write digits, or string characters, until
max_tokens runs out: the JSON never closes and never parses (SmolLM2 filled 246 of 256 tokens with the
digits of one integer for 3 of 10 seeds). llguidance's own number and string lexemes are unbounded, so the
schema is rewritten to name the bounds (bench/json_runaway.py measures the effect):

- an integer fits int64: `minimum`/`maximum` of +-(2**63 - 2048) where the schema gives none (the largest
  magnitude llguidance turns into a digit range: it reads bounds as doubles, and 2**63 - 1 rounds up to
  2**63, which it refuses); a bound beyond that is clamped to it.
- a number fits a double as a fixed-point decimal: the same range and at most `NUMBER_DECIMALS` decimals
  (`multipleOf` 1e-10, the finest llguidance reads) where the schema gives no `multipleOf`. llguidance writes
  a bounded number without an exponent, so `1e5` is written `100000`.
- a string ends: `maxLength` `MAX_STRING_CHARS` where the schema gives none and no `enum`/`const`.
- an object that names its properties has those and no others unless `additionalProperties` says so (the
  default of llama.cpp's and xgrammar's schema converters): a small model would otherwise invent one key
  after another until max_tokens (3 of the 6 SmolLM2 replies that ran out, bench/json_runaway.py).
- a value the schema leaves open (`{}`, `true`, `additionalProperties: true`, an array's items, an object
  that names no properties, `json_object` mode) is any JSON value whose numbers and strings have these
  bounds.
- whitespace: none at all (constraint.JSON_LAYOUT).

A digit range costs llguidance about 4 ms to compile for every place it appears (measured: 100 bounded
integer properties 0.45 s, against 0.01 s unbounded), so a plain `{"type": "integer"}` (or number, or string)
becomes a `$ref` to one shared definition (`simmer-integer`, ...: 100 of them 0.02 s); one with bounds of
its own gets them inline.

The request's schema is not changed (a copy is rewritten). References to the shared definitions are not
made inside `allOf` members (an intersection with a recursive definition can grow past llguidance's limits)
nor inside a subschema with its own `$id` (where `#/$defs/...` names another document): bounds are written
inline there, and open values left to llguidance.
"""

from __future__ import annotations

import copy
from typing import Any

INT_BOUND = 2**63 - 2048
NUMBER_DECIMALS = 10
MAX_STRING_CHARS = 4096
PREFIX = "simmer-"  # of the shared definitions' names in $defs
_INTEGER = {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
_NUMBER = {
    "type": "number",
    "minimum": -INT_BOUND,
    "maximum": INT_BOUND,
    "multipleOf": 10.0**-NUMBER_DECIMALS,
}
_STRING = {"type": "string", "maxLength": MAX_STRING_CHARS}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/$defs/{PREFIX}{name}"}


def shared_definitions() -> dict[str, Any]:
    """The bounded lexemes, and any JSON value made of them (its containers refer back to it)."""
    return {
        f"{PREFIX}integer": dict(_INTEGER),
        f"{PREFIX}number": dict(_NUMBER),
        f"{PREFIX}string": dict(_STRING),
        f"{PREFIX}any": {
            "anyOf": [
                {"type": "null"},
                {"type": "boolean"},
                _ref("number"),
                _ref("string"),
                {"type": "array", "items": _ref("any")},
                {"type": "object", "additionalProperties": _ref("any")},
            ]
        },
    }


# Keywords that constrain a value: a schema with none of them accepts anything.
_CONSTRAINING = {
    "type",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "$ref",
    "$dynamicRef",
    "$recursiveRef",
    "if",
    "properties",
    "patternProperties",
    "additionalProperties",
    "required",
    "minProperties",
    "maxProperties",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "minItems",
    "maxItems",
    "uniqueItems",
    "unevaluatedItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
}


def bound_schema(schema: Any) -> dict[str, Any]:
    """A copy of `schema` (a JSON schema; None, `true` or `{}`: any value) with every lexeme bounded."""
    if schema is None or schema is True or (isinstance(schema, dict) and _is_open(schema)):
        root: dict[str, Any] = {**(schema if isinstance(schema, dict) else {}), **_ref("any")}
    elif isinstance(schema, dict):
        root = copy.deepcopy(schema)
        _Rewriter().run(root)
    else:
        return schema  # `false` or not a schema: llguidance refuses it as it is
    defs = root.get("$defs")
    if defs is not None and not isinstance(defs, dict):
        return root  # llguidance refuses a malformed $defs as it is
    root["$defs"] = {**(defs or {}), **shared_definitions()}
    return root


def _is_open(schema: dict) -> bool:
    return not (_CONSTRAINING & schema.keys())


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


class _Rewriter:
    """Rewrites a deep copy in place, iteratively (the schema may be as deep as the request allows)."""

    def run(self, root: dict) -> None:
        # (schema, may refer to the shared definitions: not inside allOf or a nested $id)
        todo: list[tuple[dict, bool]] = [(root, True)]
        while todo:
            node, shared = todo.pop()
            self._lexemes(node)
            if shared:
                self._open_values(node)
            for where, child, value_position, in_all_of in _children(node):
                replace = shared and value_position and not in_all_of
                if child is True and replace:
                    _replace(node, where, _ref("any"))
                elif isinstance(child, dict):
                    plain = _plain(child) if replace and "$id" not in child else None
                    if plain is not None:
                        rest = {k: v for k, v in child.items() if k != "type"}
                        _replace(node, where, {**rest, **_ref(plain)})
                        continue
                    todo.append((child, shared and not in_all_of and "$id" not in child))

    @staticmethod
    def _lexemes(node: dict) -> None:
        types = _types(node)
        if "enum" in node or "const" in node:
            return
        if "number" in types or "integer" in types:
            for key, sign in (("minimum", -1), ("maximum", 1)):
                exclusive = "exclusiveMinimum" if sign < 0 else "exclusiveMaximum"
                for name in (key, exclusive):
                    value = node.get(name)
                    if (
                        isinstance(value, int | float)
                        and not isinstance(value, bool)
                        and abs(value) > INT_BOUND
                    ):
                        node[name] = sign * INT_BOUND if value * sign > 0 else value
                if not (_is_number(node.get(key)) or _is_number(node.get(exclusive))):
                    node[key] = sign * INT_BOUND
            if "integer" not in types and "multipleOf" not in node:
                node["multipleOf"] = 10.0**-NUMBER_DECIMALS
        if "string" in types and "maxLength" not in node:
            node["maxLength"] = MAX_STRING_CHARS

    @staticmethod
    def _open_values(node: dict) -> None:
        types = _types(node)
        objects = "object" in types or "properties" in node or "patternProperties" in node
        named = node.get("properties")
        required = node.get("required")
        if (
            isinstance(named, dict)
            and named
            and "additionalProperties" not in node
            and "patternProperties" not in node
            and all(name in named for name in (required if isinstance(required, list) else ()))
        ):
            node["additionalProperties"] = False  # the properties it names, as llama.cpp and xgrammar do
        elif objects and node.get("additionalProperties", True) is True:
            node["additionalProperties"] = _ref("any")
        arrays = "array" in types or "prefixItems" in node
        if arrays and node.get("items", True) is True:
            node["items"] = _ref("any")


def _plain(schema: dict) -> str | None:
    """The shared definition a schema is (open: `any`; one lexeme type and nothing else: that type)."""
    keys = _CONSTRAINING & schema.keys()
    if not keys:
        return "any"
    kind = schema.get("type")
    if keys == {"type"} and kind in ("integer", "number", "string"):
        return kind
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _children(node: dict) -> list[tuple[tuple[str, Any], Any, bool, bool]]:
    """(where, subschema, holds a value of the instance, is an allOf member) for each subschema."""
    out: list[tuple[tuple[str, Any], Any, bool, bool]] = []
    for key in ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames"):
        if key in node and not isinstance(node[key], list):
            out.append(((key, None), node[key], key in ("additionalProperties", "items"), False))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
        value = node.get(key)
        if isinstance(value, list):
            out += [((key, i), v, key != "allOf", key == "allOf") for i, v in enumerate(value)]
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        value = node.get(key)
        if isinstance(value, dict):
            out += [((key, name), v, key != "dependentSchemas", False) for name, v in value.items()]
    return out


def _replace(node: dict, where: tuple[str, Any], value: dict) -> None:
    key, sub = where
    if sub is None:
        node[key] = value
    else:
        node[key][sub] = value
