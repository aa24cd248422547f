"""What every dialect's request validation shares: strict bodies, integers as JSON Schema has them, the
400 raised inside a validator, and the sampling bounds, declared once as annotated types (each dialect's
protocol.py types its fields with them; the numeric limits are the sampler's, models/runtime/sampling.py).
"""

from __future__ import annotations

from typing import Annotated, Any

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


def _check_text_and_depth(data: Any) -> None:
    """Raise for the first string (key or value) holding a lone surrogate, naming its JSON path: JSON
    allows "\\ud800", but that is no Unicode text (it cannot be encoded, tokenized or sent back). Raise
    invalid_json for nesting deeper than MAX_JSON_DEPTH. Iterative, so deep input costs no recursion."""
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        path, value, depth = stack.pop()  # depth: the containers around `value`
        if isinstance(value, (dict, list)) and depth >= MAX_JSON_DEPTH:
            raise PydanticCustomError(
                "invalid_json", "Request body is nested deeper than {depth} levels", {"depth": MAX_JSON_DEPTH}
            )
        if isinstance(value, str):
            if not _is_text(value):
                _surrogate(path or "body")
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                sub = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not _is_text(key):
                    _surrogate(sub.encode("utf-8", "backslashreplace").decode())
                stack.append((sub, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in reversed(list(enumerate(value))))


def _surrogate(path: str) -> None:
    # {param} is filled in by pydantic from the context: the path itself may hold braces.
    raise invalid("{param}: the string contains a lone surrogate (not valid Unicode)", path)


class StrictBody(BaseModel):
    """A request body: strict types, and no lone surrogate or over-deep nesting anywhere in it."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _check_text_and_depth(data)
        return data


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
RouteMode = Mode  # where to serve it (or the X-Simmer-Route header)


def valid_keep_alive(value: Any) -> Any:
    """A request's keep_alive as given, once it parses (OpenAI's and Ollama's declare it apart: they
    publish different schemas); the 400 names `keep_alive`."""
    try:
        parse_keep_alive(value)
    except InvalidParameter as err:
        raise invalid(err.message, "keep_alive") from None
    return value
