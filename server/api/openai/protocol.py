"""OpenAI-shaped wire models. Requests are validated here and translated once into the internal request
(translate.py); responses and stream chunks are built by small functions so the route and the stream share
one shape.

Nothing outside the dialect folders sees these types (the router and the worker take a GenerationRequest).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
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

from models.errors import InvalidParameter
from models.runtime.sampling import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from models.types import (
    FinishEvent,
    Timings,
    TokenEvent,
    ToolCallDelta,
    Usage,
)
from server.api.common.fields import invalid as _invalid
from server.api.common.tools import check_tools
from server.http.errors import MAX_JSON_DEPTH
from server.serving.keep_alive import PATTERN as KEEP_ALIVE_PATTERN
from server.serving.keep_alive import parse_keep_alive

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


NonEmpty = Annotated[str, StringConstraints(min_length=1)]
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]  # JSON keys are strings
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
_LOGIT_BIAS = {
    "type": ["object", "null"],
    "propertyNames": {"pattern": TokenId.__metadata__[0].pattern},
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
    "description": "token id -> bias added to its logit; ids must be in the model's vocabulary",
}


_SCHEMA_OBJECT = {
    "type": ["object", "null"],
    "description": "a JSON Schema (docs/structured.md lists what is supported)",
}
_PARAMETERS = {
    "type": ["object", "null"],
    "properties": {"type": {"const": "object"}},
    "description": "a JSON Schema of the arguments object (docs/structured.md lists what is supported)",
}
_JSON_SCHEMA_EXTRA = {
    "type": ["object", "null"],
    "description": "llama.cpp's extra: the reply is JSON valid against this JSON Schema",
}
_GRAMMAR = {"type": ["string", "null"], "description": "llama.cpp's extra: a GBNF grammar the reply follows"}


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: FunctionName | None = None  # OpenAI requires it; simmer does not need it
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, WithJsonSchema(_SCHEMA_OBJECT)] = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's form {"type": "json_object", "schema": {...}}
    schema_: Annotated[dict[str, Any] | None, WithJsonSchema(_SCHEMA_OBJECT)] = Field(None, alias="schema")


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
    # Structured output (docs/structured.md): OpenAI's response_format, llama.cpp's json_schema and grammar.
    response_format: ResponseFormat | None = None
    json_schema: Annotated[dict[str, Any] | None, WithJsonSchema(_JSON_SCHEMA_EXTRA)] = None
    grammar: Annotated[str | None, WithJsonSchema(_GRAMMAR)] = None
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
    # Ollama's: how long the model stays loaded after this request ("5m", seconds; 0 unloads it after the
    # reply, negative keeps it). Default: SIMMER_KEEP_ALIVE_S.
    keep_alive: Annotated[
        float | str | None,
        WithJsonSchema(
            {
                "anyOf": [{"type": ["number", "null"]}, {"type": "string", "pattern": KEEP_ALIVE_PATTERN}],
                "description": 'seconds, or a duration such as "5m"; 0 unloads the model after the reply, '
                "negative keeps it loaded",
            }
        ),
    ] = None
    route: Literal["local", "auto", "upstream"] | None = None  # where to serve it (or X-Simmer-Route)
    # vLLM's: a secret of the client's; prefixes are reused only between requests with the same salt (and
    # the same API key), so cached_tokens cannot reveal another client's prompt (serving/cache_scope.py)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise _invalid("n must be 1: simmer generates one choice per request")
        return n

    @model_validator(mode="after")
    def _one_constraint(self) -> _GenerationRequest:
        # Which fields ask for a grammar, not the grammar itself: converting one (a 64 KB GBNF grammar takes
        # a fraction of a second) is left to the one parse (server/serving/request.py), off the event loop.
        asked = self.constraint_fields()
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise _invalid("response_format.json_schema is required with type json_schema", "response_format")
        if len(asked) > 1:
            raise _invalid(
                f"{asked[1]} cannot be combined with {asked[0]}: give one way to constrain the output",
                asked[1],
            )
        return self

    def constraint_fields(self) -> list[str]:
        """The fields that ask for a grammar (the validator lets one through; translate.py reads it)."""
        rf = self.response_format
        asked = ["response_format"] if rf is not None and rf.type in ("json_object", "json_schema") else []
        if self.json_schema is not None:
            asked.append("json_schema")
        if self.grammar:
            asked.append("grammar")
        return asked

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, value: float | str | None) -> float | str | None:
        try:
            parse_keep_alive(value)
        except InvalidParameter as err:
            raise _invalid(err.message, "keep_alive") from None
        return value


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def as_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        # "developer" is the newer OpenAI name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionSpec(BaseModel):
    model_config = STRICT

    name: FunctionName
    description: str | None = None
    # A JSON schema of the arguments object (absent: any object). Unsupported keywords: 400.
    parameters: Annotated[dict[str, Any] | None, WithJsonSchema(_PARAMETERS)] = None
    strict: bool | None = None  # calls always follow the schema (simmer constrains them)


class ToolSpec(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(BaseModel):
    model_config = STRICT

    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: ChosenFunction


def check_openai_tools(
    tools: list[ToolSpec] | None, choice: Literal["none", "auto", "required"] | NamedToolChoice | None
) -> None:
    """OpenAI's tools (and Ollama's, which are OpenAI's): the shared rules, named in OpenAI's paths."""
    check_tools(
        [t.function.name for t in tools or ()],
        [t.function.parameters for t in tools or ()],
        choice_given=choice is not None,
        chosen=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        params_path=lambda i: f"tools[{i}].function.parameters",
    )


class ChatCompletionRequest(_GenerationRequest):
    # top_logprobs (a number) needs logprobs: true, as OpenAI has it.
    # and tool_choice needs tools.
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
                    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
                },
                {
                    "if": {
                        "properties": {"tool_choice": {"not": {"type": "null"}}},
                        "required": ["tool_choice"],
                    },
                    "then": {
                        "properties": {"tools": {"type": "array", "minItems": 1}},
                        "required": ["tools"],
                    },
                },
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        check_openai_tools(self.tools, self.tool_choice)
        calls = bool(self.tools) and self.tool_choice != "none"
        if calls and self.constraint_fields():
            raise _invalid(
                f"{self.constraint_fields()[0]} cannot be combined with tool calls (use tool_choice 'none')",
                self.constraint_fields()[0],
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        return self


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


# ---- responses ---------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage_dict(usage: Usage) -> dict:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.by_model:  # simmer: which model produced how many tokens (several when the governor moved it)
        body["models"] = dict(usage.by_model)
    return body


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
    return {"content": content, "refusal": None}


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
    return {
        "timings": timings_dict(finish.timings),
        "truncated": finish.truncated,
        "summarized": finish.summarized,
    }


def _fingerprint(variant: str | None) -> str | None:
    return f"simmer-{variant}" if variant else None


def _finish_reason(finish: FinishEvent) -> str:
    # OpenAI knows stop/length/tool_calls; a cancelled generation that still answers reports what it has.
    return finish.finish_reason if finish.finish_reason in ("stop", "length", "tool_calls") else "stop"


def call_deltas(tokens: list[TokenEvent], finish: FinishEvent | None = None) -> list[ToolCallDelta]:
    return [d for ev in tokens for d in ev.tool_calls] + list(finish.tool_calls if finish else ())


def assemble_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """OpenAI message.tool_calls from the engine's call deltas (arguments: JSON text; incomplete when
    max_tokens cut the call short, finish_reason "length")."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(
            d.index, {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        )
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def _stream_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """Stream-chunk tool_calls: one entry per call index; the call's first chunk carries its id, type and
    name (the openai SDK's stream helpers read them from there), later ones only arguments."""
    out: dict[int, dict] = {}
    for d in deltas:
        entry = out.get(d.index)
        if entry is None:
            entry = out[d.index] = {"index": d.index}
            if d.id is not None:
                entry.update({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            else:
                entry["function"] = {"arguments": ""}
        entry["function"]["arguments"] += d.arguments
    return [out[i] for i in sorted(out)]


def chat_completion(
    rid: str, model: str, text: str, tokens: list[TokenEvent], finish: FinishEvent, variant: str | None
) -> dict:
    # refusal: OpenAI's spec requires the field; simmer's models never refuse by a separate channel
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    calls = assemble_calls(call_deltas(tokens, finish))
    if calls:
        message = {"role": "assistant", "content": text or None, "refusal": None, "tool_calls": calls}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": _fingerprint(variant),
        "choices": [
            {
                "index": 0,
                "message": message,
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
        self._held: list[TokenEvent] = []  # tokens of batches that showed nothing yet (their logprobs)
        self.variant: str | None = None  # known once the worker starts the job
        # Fields of the final chunk (and the usage chunk) known only at the end: the route object.
        self.final_fields: Callable[[], dict] = dict

    def started(self, model_id: str | None, variant: str | None) -> None:
        """The model that runs the reply from now on (the governor may move it to another mid-way)."""
        if model_id:
            self.model = model_id
        self.variant = variant

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

    def delta(self, text: str, tokens: list[TokenEvent], finish: FinishEvent | None = None) -> list[dict]:
        """The chunks for one batch of tokens (and the finish, at the end): none when the batch shows nothing
        (bytes the detokenizer holds, a call's envelope); its tokens' logprobs then go with the next chunk.
        As OpenAI streams: the role comes alone in the first chunk (`content` null); no delta carries empty
        content; the last chunk's delta is empty, with the finish_reason."""
        tokens = self._held + tokens
        self._held = []
        chunks = []
        if self.kind == "chat":
            calls = _stream_calls(call_deltas(tokens, finish))
            if not self._role_sent:  # the role-only opening chunk, before anything else
                self._role_sent = True
                chunks.append(self._choice({"role": "assistant", "content": None}))
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            if delta:
                chunks.append(self._choice(delta, chat_logprobs(tokens)))
            elif finish is None:
                self._held = tokens
            if finish is not None:
                logprobs = None if delta else chat_logprobs(tokens)
                chunks.append(self._choice({}, logprobs, finish))
        else:
            if text or finish is not None:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": completion_logprobs(tokens, self._offset),
                    "finish_reason": _finish_reason(finish) if finish else None,
                }
                self._offset += len(text)
                chunks.append(
                    self._final(self._chunk([choice], finish.variant), finish)
                    if finish
                    else self._chunk([choice])
                )
            else:
                self._held = tokens
        return chunks

    def _choice(
        self, delta: dict[str, Any], logprobs: dict | None = None, finish: FinishEvent | None = None
    ) -> dict:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(finish) if finish else None,
        }
        chunk = self._chunk([choice], finish.variant if finish else None)
        return self._final(chunk, finish) if finish else chunk

    def _final(self, chunk: dict, finish: FinishEvent) -> dict:
        chunk.update(_extras(finish))
        chunk.update(self.final_fields())
        return chunk

    def usage(self, finish: FinishEvent) -> dict:
        chunk = self._chunk([], finish.variant)
        chunk["usage"] = usage_dict(finish.usage)
        chunk.update(_extras(finish))
        chunk.update(self.final_fields())
        return chunk
