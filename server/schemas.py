"""OpenAI-shaped wire models. Requests convert themselves to engine params (`to_params`); responses and
stream chunks are built by small functions so the route and the stream share one shape.

Nothing below `server/` sees these types (the worker hands the engine GenerationParams and messages).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from models.runtime.sampling import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from models.types import FinishEvent, GenerationParams, SamplingParams, Timings, TokenEvent, Usage

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


def _invalid(message: str, param: str | None = None) -> PydanticCustomError:
    # A custom error keeps our exact wording (a ValueError would be prefixed "Value error, "); `param`
    # names the field when the error is raised above it (server/errors.py reads it).
    return PydanticCustomError("invalid_parameter", message, {"param": param} if param else None)


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
MAX_JSON_DEPTH = 64


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
    raise _invalid("{param}: the string contains a lone surrogate (not valid Unicode)", path)


class _Request(BaseModel):
    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _check_text_and_depth(data)
        return data


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets. OpenAI's own defaults (temperature 1, no
    truncation) let a small model wander into its long tail; llama.cpp's server and Ollama default to a
    truncated distribution, and so does simmer (server/settings.py)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


OPENAI_DEFAULTS = SamplingDefaults()

NonEmpty = Annotated[str, StringConstraints(min_length=1)]
TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]  # JSON keys are strings
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
_UNSUPPORTED = "simmer does not support tools yet"
_LOGIT_BIAS = {
    "type": ["object", "null"],
    "propertyNames": {"pattern": TokenId.__metadata__[0].pattern},
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
    "description": "token id -> bias added to its logit; ids must be in the model's vocabulary",
}


class _GenerationRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: Annotated[AnyInteger, WithJsonSchema({"type": "integer", "enum": [1], "default": 1})] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[NonEmpty] | None = None
    # Any int64, negative included: -1 is an ordinary, reproducible seed (models/runtime/sampling.py).
    # (lt 2**63 rather than le 2**63 - 1: the same bound, and exact in the float64 JSON tools parse it to)
    seed: integer(ge=SEED_MIN, lt=SEED_MAX + 1) | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Token id (a string, as JSON keys are) -> -100..100 added to its logit; ids beyond the vocabulary
    # get a 400 from the route, which knows the model.
    logit_bias: Annotated[dict[TokenId, Bias] | None, WithJsonSchema(_LOGIT_BIAS)] = None
    # Refused until tools exist (OpenAI also refuses tool_choice without tools).
    tool_choice: Annotated[Any, WithJsonSchema({"type": "null", "description": _UNSUPPORTED})] = None
    # llama.cpp extras
    top_k: integer(ge=0) | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    # vLLM's name for the same thing
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    # simmer extras
    truncate: bool = False  # sliding-window truncation instead of context_length_exceeded
    ignore_eos: bool = False  # llama.cpp's: generate exactly max_tokens (benchmarks)
    governor_events: bool = False  # opt in to `event: governor` SSE events (SDKs would choke on them)
    route: Literal["local", "auto", "upstream"] | None = None  # where to serve it (or X-Simmer-Route)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise _invalid("n must be 1: simmer generates one choice per request")
        return n

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, tool_choice: Any) -> Any:
        if tool_choice is not None:
            raise _invalid(f"tool_choice needs tools, and {_UNSUPPORTED}")
        return tool_choice

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None or self.stop == "":
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _params(
        self, max_tokens: int | None, logprobs: int | None, defaults: SamplingDefaults
    ) -> GenerationParams:
        penalty = self.repeat_penalty or self.repetition_penalty or 1.0
        sampling = SamplingParams(
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            repetition_penalty=penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            logprobs=logprobs,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
        )
        return GenerationParams(
            sampling=sampling,
            max_tokens=max_tokens,
            stop=self._stop_tuple(),
            truncate=self.truncate,
            ignore_eos=self.ignore_eos,
        )


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        # "developer" is the newer OpenAI name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


_NO_TOOLS = {"type": ["array", "null"], "maxItems": 0, "description": _UNSUPPORTED}
_TEXT_FORMAT = {"type": ["object", "null"], "properties": {"type": {"type": "string", "enum": ["text"]}}}


class ChatCompletionRequest(_GenerationRequest):
    # top_logprobs (a number) needs logprobs: true, as OpenAI has it.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    tools: Annotated[list[Any] | None, WithJsonSchema(_NO_TOOLS)] = None
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(_TEXT_FORMAT)] = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.tools:
            raise _invalid(_UNSUPPORTED, "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise _invalid("only response_format type 'text' is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        return self

    def message_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]

    def to_params(self, defaults: SamplingDefaults = OPENAI_DEFAULTS) -> GenerationParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.max_completion_tokens or self.max_tokens, logprobs, defaults)


_ONE_STRING_LIST = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}
_ONE_PROMPT = {"anyOf": [{"type": "string"}, _ONE_STRING_LIST]}


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[str | list[str], WithJsonSchema(_ONE_PROMPT)]
    logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    echo: Annotated[bool, WithJsonSchema({"type": "boolean", "enum": [False], "default": False})] = False
    suffix: Annotated[str | None, WithJsonSchema({"type": ["string", "null"], "maxLength": 0})] = None
    best_of: Annotated[
        AnyInteger | None, WithJsonSchema({"type": ["integer", "null"], "enum": [1, None]})
    ] = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise _invalid("prompt must be one string (batches are not supported)", "prompt")
        if self.echo:
            raise _invalid("echo is not supported", "echo")
        if self.suffix:
            raise _invalid("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise _invalid("best_of must be 1", "best_of")
        return self

    def prompt_text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    def to_params(self, defaults: SamplingDefaults = OPENAI_DEFAULTS) -> GenerationParams:
        return self._params(self.max_tokens, self.logprobs, defaults)


# ---- responses ---------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage_dict(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def timings_dict(timings: Timings) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(timings).items()}


def _token_text(ev: TokenEvent) -> str:
    return ev.token_text if ev.token_text is not None else ev.text


def chat_logprobs(events: list[TokenEvent]) -> dict | None:
    if not events or all(ev.logprob is None for ev in events):
        return None
    content = []
    for ev in events:
        text = _token_text(ev)
        tops = [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in ev.top_logprobs or ()
        ]
        content.append(
            {"token": text, "logprob": ev.logprob, "bytes": list(text.encode()), "top_logprobs": tops}
        )
    return {"content": content}


def completion_logprobs(events: list[TokenEvent], offset: int = 0) -> dict | None:
    if not events or all(ev.logprob is None for ev in events):
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for ev in events:
        text = _token_text(ev)
        tokens.append(text)
        token_logprobs.append(ev.logprob)
        tops.append({t.token: t.logprob for t in ev.top_logprobs or ()})
        offsets.append(offset)
        offset += len(ev.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _extras(finish: FinishEvent) -> dict:
    return {"timings": timings_dict(finish.timings), "truncated": finish.truncated}


def _fingerprint(variant: str | None) -> str | None:
    return f"simmer-{variant}" if variant else None


def _finish_reason(finish: FinishEvent) -> str:
    # OpenAI knows stop/length; a cancelled generation that still answers reports what it has.
    return finish.finish_reason if finish.finish_reason in ("stop", "length") else "stop"


def chat_completion(
    rid: str, model: str, text: str, tokens: list[TokenEvent], finish: FinishEvent, variant: str | None
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": _fingerprint(variant),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(tokens),
                "finish_reason": _finish_reason(finish),
            }
        ],
        "usage": usage_dict(finish.usage),
        **_extras(finish),
    }


def text_completion(
    rid: str, model: str, text: str, tokens: list[TokenEvent], finish: FinishEvent, variant: str | None
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "system_fingerprint": _fingerprint(variant),
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(tokens),
                "finish_reason": _finish_reason(finish),
            }
        ],
        "usage": usage_dict(finish.usage),
        **_extras(finish),
    }


class ChunkBuilder:
    """Builds the stream chunks of one response (chat or text completion)."""

    def __init__(self, kind: Literal["chat", "text"], rid: str, model: str) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.created = now()
        self._role_sent = False
        self._offset = 0  # text offset for completion logprobs
        self.variant: str | None = None  # known once the worker starts the job
        # Fields of the final chunk (and the usage chunk) known only at the end: the route object.
        self.final_fields: Callable[[], dict] = dict

    def _chunk(self, choices: list[dict], variant: str | None = None) -> dict:
        variant = variant or self.variant
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": _fingerprint(variant),
            "choices": choices,
        }

    def delta(self, text: str, tokens: list[TokenEvent], finish: FinishEvent | None = None) -> dict:
        finish_reason = _finish_reason(finish) if finish else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": chat_logprobs(tokens),
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(tokens, self._offset),
                "finish_reason": finish_reason,
            }
            self._offset += len(text)
        chunk = self._chunk([choice], finish.variant if finish else None)
        if finish is not None:
            chunk.update(_extras(finish))
            chunk.update(self.final_fields())
        return chunk

    def usage(self, finish: FinishEvent) -> dict:
        chunk = self._chunk([], finish.variant)
        chunk["usage"] = usage_dict(finish.usage)
        chunk.update(_extras(finish))
        chunk.update(self.final_fields())
        return chunk
