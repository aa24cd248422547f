"""Tool calls a model wrote its own way, recognised in `tool_choice: "auto"`.

Under `auto` the grammar lets a model answer in free text, and small models often write their call as text
rather than in the envelope the grammar would have enforced: Qwen2.5-Coder 1.5B as a fenced JSON block,
0.5B as a bare JSON object, sometimes Hermes markup with other whitespace. A reply that is exactly one of

    {"name": F, "arguments": {...}}                        bare (or "parameters" for the arguments)
    ```json\\n{"name": F, "arguments": {...}}\\n```          fenced (no language or json)
    <tool_call>{"name": F, "arguments": {...}}</tool_call>  the template's markup, several when parallel

with whitespace around its parts, F a declared function and the arguments (an object, or a string holding
one; absent: {}) valid against F's schema, is that call. Anything else, and any reply cut short (length,
a client's stop string inside it), stays text: a word of prose, a second object, another key, a name not
declared, arguments that fail the schema.

`LooseScan` reads the reply as it streams, one character at a time, and says as early as it can when the
text can no longer be such a call (a key other than those, a name no declared function begins with, text
after the object), so the reader holds back only what could still become one. `parse` decides at the end.
The arguments are checked by llguidance, the library that enforces the schemas of forced calls, over a
vocabulary of single bytes: the same JSON Schema subset and semantics, and its regular expressions run in
linear time (a client's `pattern` cannot stall the worker). llguidance reads object properties in the
schema's order, so the arguments are first put in that order (`schema_order`); the call's arguments are
delivered that way, in the canonical layout forced calls have.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from models.errors import InvalidParameter
from models.runtime.constraint import LIMITS, json_schema_grammar
from models.types import Tool

NAME_KEY = "name"
ARGS_KEYS = ("arguments", "parameters")
TOP_KEYS = (NAME_KEY, *ARGS_KEYS)
FENCE = "```"
FENCE_LANGS = ("", "json")  # lower-cased
MARKUP_OPEN, MARKUP_CLOSE = "<tool_call>", "</tool_call>"
MAX_LANG = 16


@dataclass(frozen=True)
class LooseCall:
    name: str
    arguments: str  # JSON text in the canonical layout, valid against the function's schema


class LooseScan:
    """An incremental check that a reply may still be one loosely written call (see the module doc)."""

    def __init__(self, tools: Iterable[Tool], *, markup: bool, parallel: bool) -> None:
        self.names = tuple(t.name for t in tools)
        self.markup = markup  # the template's own <tool_call> markup is accepted
        self.parallel = parallel
        self.text: list[str] = []
        self.objects: list[str] = []
        self._state = "lead"  # lead fence lang open obj after close_fence close_markup trail dead
        self._kind = ""  # bare | fenced | markup
        self._lit = ""  # the literal being matched (fence, markup)
        self._lang = ""
        self._lang_done = False
        self._obj: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "key"  # at depth 1: key | colon | value | comma
        self._key: list[str] | None = None  # a top-level key being read
        self._seen: set[str] = set()
        self._last_key = ""
        self._name: list[str] | None = None  # the name's value being read

    @property
    def viable(self) -> bool:
        return self._state != "dead"

    @property
    def complete(self) -> bool:
        """The text so far is a whole call (or several): it is one if the reply ends here."""
        if self._state == "after":
            return self._kind == "bare"
        return self._state == "trail"

    def feed(self, text: str) -> bool:
        """Read more of the reply; False once it cannot be a call (then it stays so)."""
        self.text.append(text)
        for ch in text:
            if self._state == "dead":
                break
            self._step(ch)
        return self.viable

    # -- the frame around the object ------------------------------------------------------------------
    def _step(self, ch: str) -> None:
        s = self._state
        if s == "obj":
            self._obj_char(ch)
        elif s == "lead":
            if ch.isspace():
                return
            if ch == "{":
                self._open("bare")
            elif ch == "`":
                self._state, self._lit = "fence", ch
            elif ch == "<" and self.markup:
                self._state, self._lit = "open", ch
            else:
                self._state = "dead"
        elif s == "fence":
            self._literal(ch, FENCE, "lang")
        elif s == "lang":
            known = self._lang.lower() in FENCE_LANGS
            if ch == "{" and known:
                self._open("fenced")
            elif ch.isspace() and known:
                self._lang_done = True  # only whitespace until the object
            elif (ch.isalnum() or ch in "_-") and not self._lang_done and len(self._lang) < MAX_LANG:
                self._lang += ch
            else:
                self._state = "dead"
        elif s == "open":
            if self._lit == MARKUP_OPEN:
                if ch == "{":
                    self._open("markup")
                elif not ch.isspace():
                    self._state = "dead"
            else:
                self._literal(ch, MARKUP_OPEN, "open")
        elif s == "after":
            if ch.isspace():
                return
            if self._kind == "fenced" and ch == "`":
                self._state, self._lit = "close_fence", ch
            elif self._kind == "markup" and ch == "<":
                self._state, self._lit = "close_markup", ch
            else:
                self._state = "dead"
        elif s == "close_fence":
            self._literal(ch, FENCE, "trail")
        elif s == "close_markup":
            self._literal(ch, MARKUP_CLOSE, "trail")
        elif s == "trail":
            if ch.isspace():
                return
            if self._kind == "markup" and ch == "<" and self.parallel:
                self._state, self._lit = "open", ch  # another call
            else:
                self._state = "dead"

    def _literal(self, ch: str, literal: str, then: str) -> None:
        """Match `literal` a character at a time (self._lit holds what matched); `then` once whole."""
        if len(self._lit) < len(literal) and literal[len(self._lit)] == ch:
            self._lit += ch
            if self._lit == literal:
                self._state = then
        else:
            self._state = "dead"

    def _open(self, kind: str) -> None:
        self._kind, self._state = kind, "obj"
        self._obj = ["{"]
        self._depth, self._in_string, self._escape = 1, False, False
        self._expect, self._key, self._seen, self._last_key, self._name = "key", None, set(), "", None

    # -- the object: JSON, with its top-level keys and name checked as they come ---------------------------
    def _obj_char(self, ch: str) -> None:
        self._obj.append(ch)
        if self._in_string:
            self._string_char(ch)
            return
        if ch.isspace():
            return
        top = self._depth == 1
        if ch == '"':
            self._in_string = True
            if top:
                if self._expect == "key":
                    self._key = []
                elif self._expect == "value" and self._last_key == NAME_KEY:
                    self._name = []
                elif not (self._expect == "value" and self._last_key in ARGS_KEYS):
                    self._state = "dead"
            return
        if top:
            if self._expect == "colon":
                self._expect = "value" if ch == ":" else "dead"
            elif self._expect == "comma":
                if ch == ",":
                    self._expect = "key"
                elif ch == "}":
                    self._close()
                    return
                else:
                    self._expect = "dead"
            elif self._expect == "value":
                # the name is a string (handled above); the arguments an object or a string
                if self._last_key in ARGS_KEYS and ch == "{":
                    self._depth += 1
                    self._expect = "comma"
                    return
                self._expect = "dead"
            else:
                self._expect = "dead"
            if self._expect == "dead":
                self._state = "dead"
            return
        if ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def _string_char(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
            if self._key is not None or self._name is not None:
                self._state = "dead"  # an escaped key or function name: not a name we declared
                return
        elif ch == '"':
            self._in_string = False
            if self._key is not None:
                key = "".join(self._key)
                self._key = None
                args_seen = any(k in self._seen for k in ARGS_KEYS)
                if key not in TOP_KEYS or key in self._seen or (key in ARGS_KEYS and args_seen):
                    self._state = "dead"
                    return
                self._seen.add(key)
                self._last_key, self._expect = key, "colon"
            elif self._name is not None:
                name = "".join(self._name)
                self._name = None
                if name not in self.names:
                    self._state = "dead"
                    return
                self._expect = "comma"
            elif self._depth == 1:
                self._expect = "comma"  # the arguments as a string
            return
        if self._key is not None:
            self._key.append(ch)
            key = "".join(self._key)
            if not any(k.startswith(key) for k in TOP_KEYS):
                self._state = "dead"
        elif self._name is not None:
            self._name.append(ch)
            name = "".join(self._name)
            if not any(n.startswith(name) for n in self.names):
                self._state = "dead"

    def _close(self) -> None:
        if NAME_KEY not in self._seen:
            self._state = "dead"  # no function named
            return
        self.objects.append("".join(self._obj))
        self._obj = []
        self._depth = 0
        self._state = "after"


# ---- the decision at the end ---------------------------------------------------------------------------


def parse(scan: LooseScan, tools: Iterable[Tool]) -> list[LooseCall] | None:
    """The calls a complete reply spells, or None: it stays text."""
    if not scan.complete or not scan.objects:
        return None
    schemas = {t.name: t.parameters for t in tools}
    calls = []
    for text in scan.objects:
        call = _one(text, schemas)
        if call is None:
            return None
        calls.append(call)
    return calls


def _one(text: str, schemas: Mapping[str, dict | None]) -> LooseCall | None:
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get(NAME_KEY), str):
        return None
    name = obj[NAME_KEY]
    given = [k for k in ARGS_KEYS if k in obj]
    if name not in schemas or set(obj) - set(TOP_KEYS) or len(given) > 1:
        return None
    args: Any = obj[given[0]] if given else {}
    if isinstance(args, str):
        try:
            args = json.loads(args, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    schema = schemas[name] or {"type": "object"}
    try:
        arguments = json.dumps(schema_order(args, schema), ensure_ascii=False)
    except RecursionError:  # nested deeper than the checks go: not a call we can vouch for
        return None
    return LooseCall(name, arguments) if valid(arguments, schema) else None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key given twice")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# ---- arguments in the schema's order, checked by llguidance ----------------------------------------------


def schema_order(value: Any, schema: Any) -> Any:
    """`value` with every object's keys in the order llguidance reads them under `schema`: the properties
    the schema names, in its order (branches of anyOf/oneOf/allOf and $ref targets included), then the
    others as they came."""
    root = schema if isinstance(schema, dict) else {}
    flat: dict[int, list[dict]] = {}  # each subschema flattened once, however often the value meets it
    return _order(
        value, [schema], lambda sub: flat.get(id(sub)) or flat.setdefault(id(sub), _flatten(sub, root))
    )


def _order(value: Any, schemas: list[Any], flatten: Callable[[Any], list[dict]]) -> Any:
    flat = [s for sch in schemas for s in flatten(sch)]
    if isinstance(value, dict):
        names: dict[str, list[Any]] = {}
        for s in flat:
            props = s.get("properties")
            if isinstance(props, dict):
                for k, sub in props.items():
                    names.setdefault(k, []).append(sub)
        extra = [s["additionalProperties"] for s in flat if isinstance(s.get("additionalProperties"), dict)]
        rank = {k: i for i, k in enumerate(names)}
        keys = sorted(value, key=lambda k: (0, rank[k]) if k in rank else (1, 0))  # stable: others in order
        return {k: _order(value[k], names.get(k, extra), flatten) for k in keys}
    if isinstance(value, list):
        out = []
        for i, item in enumerate(value):
            subs = []
            for s in flat:
                prefix = s.get("prefixItems")
                if isinstance(prefix, list) and i < len(prefix):
                    subs.append(prefix[i])
                elif isinstance(s.get("items"), dict):
                    subs.append(s["items"])
            out.append(_order(item, subs, flatten))
        return out
    return value


def _flatten(schema: Any, root: dict) -> list[dict]:
    """The schema and those it combines with (allOf/anyOf/oneOf, a local $ref), each once: a schema that
    refers to itself, or to one target from many branches, costs its size, not its paths."""
    out: list[dict] = []
    seen: set[int] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        more: list[Any] = []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            more.append(_resolve(ref, root))
        for key in ("allOf", "anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list):
                more += branches
        stack += reversed(more)  # depth first, in the schema's order
    return out


def _resolve(ref: str, root: dict) -> Any:
    node: Any = root
    for part in ref.lstrip("#").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, for llguidance to check text against a grammar."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<end>"]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_BYTES: llg.LLTokenizer | None = None
_BYTES_LOCK = threading.Lock()


def _byte_tokenizer() -> llg.LLTokenizer:
    global _BYTES
    with _BYTES_LOCK:
        if _BYTES is None:
            _BYTES = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()))
        return _BYTES


def valid(arguments: str, schema: dict) -> bool:
    """Whether the JSON text `arguments` (simmer's layout, the schema's property order) is valid against
    `schema`, as llguidance enforces it on forced calls."""
    try:
        grammar = json_schema_grammar(schema, param="tools")
    except InvalidParameter:  # refused when the request came: not reached
        return False
    try:
        data = list(arguments.encode())
    except UnicodeEncodeError:  # a lone surrogate (an escaped \ud800): no UTF-8 text
        return False
    matcher = llg.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=LIMITS)
    if matcher.is_error() or matcher.validate_tokens(data) != len(data):
        return False
    return bool(matcher.consume_tokens(data)) and matcher.is_accepting()
