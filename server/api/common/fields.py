"""What every dialect's request validation shares: strict bodies, integers as JSON Schema has them, the
400 raised inside a validator, and the sampling bounds, declared once as annotated types (each dialect's
requests.py types its fields with them; the numeric limits are the sampler's, models/runtime/sampling.py).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from models.errors import InvalidParameter
from models.runtime.sampling import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from server.http.errors import MAX_JSON_DEPTH
from server.serving.keep_alive import parse_keep_alive
from server.serving.request import Mode


def invalid(message: str, param: str | None = None) -> PydanticCustomError:
    """A 400 invalid_parameter raised inside a validator. A custom error keeps our exact wording (a
    ValueError would be prefixed "Value error, "); `param` names the field when the error is raised above it
    (server/http/errors.py reads it)."""
    return PydanticCustomError("invalid_parameter", message, {"param": param} if param else None)


# As strict as OpenAI's API: no coercion ("5" is not an integer, 0 is not a boolean; an integer is still a
# number, and a whole float is an integer, as JSON Schema has it), no NaN or Infinity (Python's JSON parser
# reads them, and 1e400 becomes inf), unknown fields ignored (clients send fields of newer API versions).
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _whole(value: Any) -> Any:
    # JSON Schema's "integer" is a number with no fractional part, so 5.0 is one (and the published schema
    # promises it); "5", true and 5.5 still are not.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(**bounds: int) -> Any:
    """An int field that takes whole floats, with its bounds (in this order, or the schema loses them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


AnyInteger = Annotated[int, BeforeValidator(_whole)]


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Deeper JSON is refused as invalid_json, at one documented depth rather than wherever Python's parser
# runs out of stack (about 990 levels, depending on the call stack). OpenAI requests nest about 6 deep.


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string token (its quotes inside are escaped)


def _check_text_and_depth(data: Any) -> None:
    """Raise for the first string (key or value) holding a lone surrogate, naming its JSON path: JSON
    allows "\\ud800", but that is no Unicode text (it cannot be encoded, tokenized or sent back). Raise
    invalid_json for nesting deeper than MAX_JSON_DEPTH. This runs on the event loop for every body, so
    the body is checked whole by C code: json.dumps (its UTF-8 encoding fails on a lone surrogate), a regex
    that drops the strings, and numpy's running sum of the brackets left (the nesting): about 20 ms for
    1 MB of small items, where a walk in Python took 0.3 s. Only a body with a surrogate is walked, to
    name where it is."""
    if not isinstance(data, (dict, list)):  # a JSON scalar, or the bytes of a body that was not JSON
        _walk_text(data)
        return
    try:
        text = json.dumps(data, ensure_ascii=False)
    except (RecursionError, ValueError):  # deeper than the encoder goes (far past MAX_JSON_DEPTH)
        text = None
    if text is None or _deepest(text) > MAX_JSON_DEPTH:
        raise PydanticCustomError(
            "invalid_json", "Request body is nested deeper than {depth} levels", {"depth": MAX_JSON_DEPTH}
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        _walk_text(data)


def _deepest(text: str) -> int:
    """The most containers open at once in compact JSON text (1 for a flat object)."""
    rest = np.frombuffer(_STRING.sub("", text).encode("utf-8", "surrogatepass"), np.uint8)
    step = np.isin(rest, _OPEN).astype(np.int32) - np.isin(rest, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


_OPEN = np.frombuffer(b"[{", np.uint8)
_CLOSE = np.frombuffer(b"]}", np.uint8)


def _walk_text(data: Any) -> None:
    """Raise for the first lone surrogate, naming its path (iterative: deep input costs no recursion)."""
    if isinstance(data, str):
        if not _is_text(data):
            _surrogate("body")
        return
    if not isinstance(data, (dict, list)):
        return
    # (container, where: None for the body, else (the parent's where, its key or index))
    stack: list[tuple[Any, Any]] = [(data, None)]
    while stack:
        value, where = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not key.isascii() and not _is_text(key):
                _surrogate(_path((where, key)).encode("utf-8", "backslashreplace").decode())
            if isinstance(item, str):
                if not item.isascii() and not _is_text(item):
                    _surrogate(_path((where, key)))
            elif isinstance(item, (dict, list)):
                stack.append((item, (where, key)))


def _path(where: Any) -> str:
    """`a.b[2].c` from the (parent, key) chain the walk keeps."""
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).removeprefix(".") or "body"


def _surrogate(path: str) -> None:
    # {param} is filled in by pydantic from the context: the path itself may hold braces.
    raise invalid("{param}: the string contains a lone surrogate (not valid Unicode)", path)


# How many items a request's lists and maps may hold (docs/server.md). Checked before anything else reads
# the body: validating and reporting 150,000 bad items held the event loop for seconds (pydantic builds an
# error for each), and no client needs more.
MAX_MESSAGES = 2048  # OpenAI's own limit on `messages`
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_STOP = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOKEN_IDS = 131_072  # a prompt or a detokenize list of ids: more than any served context
MAX_CONTENT_PARTS = 256  # parts of one message's content array
MAX_INPUTS = 2048  # strings or items in an `input` (Responses, Ollama's embed) or a prompt list
MAX_CHOICES = 8  # choices a request may ask for (OpenAI's n): each a reply of its own


class StrictBody(BaseModel):
    """A request body: strict types, item counts within COUNTS (field -> most items, for lists and maps),
    and no lone surrogate or over-deep nesting anywhere in it."""

    model_config = STRICT
    COUNTS: ClassVar[dict[str, int]] = {}

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            _check_text_and_depth(data)
            return data
        for name, most in cls.COUNTS.items():
            value = data.get(name)
            if isinstance(value, (list, dict)) and len(value) > most:
                raise invalid(f"{name}: at most {most} items are allowed, not {len(value)}", name)
        _check_text_and_depth(data)
        return data


MAX_TOKEN_ID = 2**31 - 1  # above any vocabulary; the route checks the model's own size


def checked_ids(value: list, field: str, *, text: bool = False) -> list:
    """`value` as token ids (with `text`, strings may stand among them), checked in one pass that stops at
    the first bad item with one error naming it: pydantic reports every bad item of 131,072 (each an error
    object), which held the event loop for seconds. Whole floats are ids, as elsewhere."""
    out = value
    for i, item in enumerate(value):
        if type(item) is int and 0 <= item <= MAX_TOKEN_ID:
            continue
        if text and isinstance(item, str):
            continue
        if type(item) is float and item.is_integer() and 0 <= item <= MAX_TOKEN_ID:
            if out is value:
                out = list(value)
            out[i] = int(item)
            continue
        what = "a token id (an integer from 0 to 2147483647)" + (" or a string" if text else "")
        raise invalid(f"{field}[{i}]: each item must be {what}", f"{field}[{i}]")
    return out


def token_ids(field: str, *, text: bool = False) -> Any:
    """A list of token ids (checked_ids); with `text`: a string, or a list where strings may stand among
    the ids (checked before the union, so that one error stands)."""

    def check(value: Any) -> Any:
        return checked_ids(value, field, text=text) if isinstance(value, list) else value

    token = Annotated[int, Field(ge=0)]  # (no maximum in the schema: the model's vocabulary is the bound)
    if text:
        return Annotated[str | list[str | token], BeforeValidator(check)]
    return Annotated[list[token], BeforeValidator(check)]


NonEmpty = Annotated[str, StringConstraints(min_length=1)]
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]  # JSON keys are strings
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
LOGIT_BIAS_SCHEMA = {
    "type": ["object", "null"],
    "propertyNames": {"pattern": TokenId.__metadata__[0].pattern},
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
    "description": "token id -> bias added to its logit; ids must be in the model's vocabulary",
}


SCHEMA_OBJECT = {
    "type": ["object", "null"],
    "description": "a JSON Schema (docs/structured.md lists what is supported)",
}
PARAMETERS = {
    "type": ["object", "null"],
    "properties": {"type": {"const": "object"}},
    "description": "a JSON Schema of the arguments object (docs/structured.md lists what is supported)",
}

# ---- the sampling bounds, once ---------------------------------------------------------------------------
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = integer(ge=0)
# Any int64, negative included: -1 is an ordinary, reproducible seed (models/runtime/sampling.py).
# (lt 2**63 rather than le 2**63 - 1: the same bound, and exact in the float64 JSON tools parse it to)
Seed = integer(ge=SEED_MIN, lt=SEED_MAX + 1)
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence and frequency
RepetitionPenalty = Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]
MaxTokens = integer(ge=1)  # max_tokens, max_completion_tokens, max_output_tokens
TopLogprobs = integer(ge=0, le=MAX_TOP_LOGPROBS)  # top_logprobs; completions' logprobs
ContextLength = integer(ge=1)  # Ollama's num_ctx (accepted, not applied)
# ---- embeddings --------------------------------------------------------------------------------------------
# `dimensions`: the bound is wider than any embedding model's width, so a huge value is refused with the
# body, before a model is looked up (server/api/common/embeddings.py checks the model's own width).
MAX_DIMENSIONS = 65_536
Dimensions = integer(ge=1, le=MAX_DIMENSIONS)
# llama.cpp's embd_normalize: -1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, > 2 p-norm
Normalize = integer(ge=-1, le=2**31 - 1)
RouteMode = Mode  # where to serve it (or the X-Simmer-Route header)


def valid_keep_alive(value: Any) -> Any:
    """A request's keep_alive as given, once it parses (OpenAI's and Ollama's declare it apart: they
    publish different schemas); the 400 names `keep_alive`."""
    try:
        parse_keep_alive(value)
    except InvalidParameter as err:
        raise invalid(err.message, "keep_alive") from None
    return value
