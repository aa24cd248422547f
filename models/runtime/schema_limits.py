"""How big and how deep a JSON schema may be before llguidance compiles it.

llguidance's schema compiler recurses as deep as the schema nests, following `$ref`s: about 4.5 KB of
native stack per schema object on the path (a chain of 930 objects linked by `$ref` overflowed an 8 MB
thread stack and killed the process, measured). Its compile time grows with the number of schema objects
(2,000 optional properties in one object: 0.5 s; 5,000: 3 s and more with a tokenizer). Both are bounded here,
in Python and without recursion, before the schema reaches the library:

- `MAX_NODES` schema objects in the document (each occurrence counted once; a `$ref` is not expanded).
- `MAX_DEPTH` schema objects on the longest path the compiler can follow, `$ref`s included. A path through
  mutually recursive definitions cannot be longer than the definitions involved, so the bound is the longest
  path through the strongly connected components of the graph (parent -> subschema, `$ref` -> its target),
  each counted with all its objects: an upper bound whatever order the compiler visits them in.
- `$ref`s point inside the document (`#` and JSON pointers `#/...`, resolved against the nearest enclosing
  `$id`, as JSON Schema has it): a reference the walk cannot follow could hide a chain from it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from models.errors import InvalidParameter

MAX_NODES = 2_000
MAX_DEPTH = 256

# Keywords whose value is one subschema, a list of subschemas, or a map of name -> subschema.
_ONE = (
    "additionalProperties",
    "additionalItems",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_UNSUPPORTED_REFS = ("$dynamicRef", "$recursiveRef")


def check_schema_limits(schema: Any, param: str) -> None:
    """Raise InvalidParameter(param) for a schema too large or too deep to compile safely."""
    graph = _Graph(param)
    graph.walk(schema)
    depth = graph.longest_path()
    if depth > MAX_DEPTH:
        raise InvalidParameter(
            f"{param}: the schema nests too deep: {depth} schema objects on one path ($ref included), "
            f"at most {MAX_DEPTH}",
            param=param,
        )


class _Graph:
    """Schema objects (dicts) as nodes; edges from a schema to its subschemas and from a `$ref` to its
    target."""

    def __init__(self, param: str) -> None:
        self.param = param
        self.index: dict[int, int] = {}  # id(dict) -> node number
        self.edges: list[list[int]] = []

    def _node(self, obj: dict, base: dict, todo: list[tuple[dict, dict, int | None]]) -> int:
        n = self.index.get(id(obj))
        if n is None:
            n = self.index[id(obj)] = len(self.edges)
            self.edges.append([])
            if len(self.edges) > MAX_NODES:
                raise InvalidParameter(
                    f"{self.param}: the schema is too large: over {MAX_NODES} schema objects",
                    param=self.param,
                )
            todo.append((obj, base, n))
        return n

    def walk(self, root: Any) -> None:
        if not isinstance(root, dict):
            return
        todo: list[tuple[dict, dict, int | None]] = []
        self._node(root, root, todo)
        while todo:
            obj, base, n = todo.pop()
            assert n is not None
            if "$id" in obj and isinstance(obj["$id"], str):
                base = obj  # "#/..." inside resolves against this resource
            for child in _subschemas(obj):
                self.edges[n].append(self._node(child, base, todo))
            for key in _UNSUPPORTED_REFS:
                if key in obj:
                    raise InvalidParameter(f"{self.param}: {key} is not supported", param=self.param)
            ref = obj.get("$ref")
            if ref is None:
                continue
            target = self._resolve(ref, base)
            if target is not None:  # a pointer to nowhere is llguidance's to refuse (it compiles nothing)
                self.edges[n].append(self._node(target, base, todo))

    def _resolve(self, ref: Any, base: dict) -> dict | None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InvalidParameter(
                f"{self.param}: $ref must point inside the schema ('#' or '#/$defs/...'), not {ref!r:.80}",
                param=self.param,
            )
        here: Any = base
        pointer = unquote(ref[1:])
        if pointer and not pointer.startswith("/"):
            raise InvalidParameter(
                f"{self.param}: $ref must be a JSON pointer ('#/$defs/...'), not {ref!r:.80}",
                param=self.param,
            )
        for token in pointer.split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(here, dict) and token in here:
                here = here[token]
            elif isinstance(here, list) and token.isdigit() and int(token) < len(here):
                here = here[int(token)]
            else:
                return None
        return here if isinstance(here, dict) else None

    def longest_path(self) -> int:
        """The most schema objects on one path, each strongly connected component counted whole
        (Tarjan's algorithm without recursion; its components come out in reverse topological order)."""
        n = len(self.edges)
        order = [-1] * n
        low = [0] * n
        on_stack = [False] * n
        stack: list[int] = []
        comp = [-1] * n
        best: list[int] = []  # per component: the longest path starting in it
        counter = 0
        for start in range(n):
            if order[start] != -1:
                continue
            work = [(start, 0)]
            order[start] = low[start] = counter
            counter += 1
            stack.append(start)
            on_stack[start] = True
            while work:
                v, i = work[-1]
                if i < len(self.edges[v]):
                    work[-1] = (v, i + 1)
                    w = self.edges[v][i]
                    if order[w] == -1:
                        order[w] = low[w] = counter
                        counter += 1
                        stack.append(w)
                        on_stack[w] = True
                        work.append((w, 0))
                    elif on_stack[w]:
                        low[v] = min(low[v], order[w])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] != order[v]:
                    continue
                members = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = len(best)
                    members.append(w)
                    if w == v:
                        break
                # every component this one reaches is complete already (reverse topological order)
                after = max(
                    (best[comp[w]] for m in members for w in self.edges[m] if comp[w] != len(best)),
                    default=0,
                )
                best.append(len(members) + after)
        return max(best, default=0)


def _subschemas(obj: dict) -> list[dict]:
    out: list[dict] = []
    for key in _ONE:
        value = obj.get(key)
        if isinstance(value, dict):
            out.append(value)
    for key in _LIST:
        value = obj.get(key)
        if isinstance(value, list):
            out += [v for v in value if isinstance(v, dict)]
    for key in _MAP:
        value = obj.get(key)
        if isinstance(value, dict):
            out += [v for v in value.values() if isinstance(v, dict)]
    return out
