"""OpenAI-shaped wire models. Requests are validated here and translated once into the internal request
(translate.py); responses and stream chunks are built by small functions so the route and the stream share
one shape.

Nothing outside the dialect folders sees these types (the router and the worker take a GenerationRequest).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from models.types import (
    FinishEvent,
    Timings,
    TokenEvent,
    ToolCallDelta,
    Usage,
)
from server.api.common.fields import (
    LOGIT_BIAS_SCHEMA,
    MAX_CHOICES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
    SCHEMA_OBJECT,
    STRICT,
    AnyInteger,
    Bias,
    FunctionName,
    MaxTokens,
    MinP,
    NonEmpty,
    Penalty,
    RepetitionPenalty,
    RouteMode,
    Seed,
    StrictBody,
    Temperature,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
    checked_ids,
    invalid,
    valid_keep_alive,
)
from server.api.common.logprobs import chat_logprobs, token_text
from server.api.common.messages import ChatMessage
from server.api.common.tools import (
    NamedToolChoice,
    ToolSpec,
    assemble_calls,
    call_deltas,
    check_openai_tools,
)
from server.serving.keep_alive import PATTERN as KEEP_ALIVE_PATTERN


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


_JSON_SCHEMA_EXTRA = {
    "type": ["object", "null"],
    "description": "llama.cpp's extra: the reply is JSON valid against this JSON Schema",
}
_GRAMMAR = {"type": ["string", "null"], "description": "llama.cpp's extra: a GBNF grammar the reply follows"}


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: FunctionName | None = None  # OpenAI requires it; simmer does not need it
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, WithJsonSchema(SCHEMA_OBJECT)] = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's form {"type": "json_object", "schema": {...}}
    schema_: Annotated[dict[str, Any] | None, WithJsonSchema(SCHEMA_OBJECT)] = Field(None, alias="schema")


class GenerationBody(StrictBody):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    COUNTS: ClassVar[dict[str, int]] = {"stop": MAX_STOP, "logit_bias": MAX_LOGIT_BIAS_ENTRIES}

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # several choices: as many replies of the request, queued together (they decode in one batch where the
    # rows allow); streamed, one choice only for now
    n: Annotated[
        AnyInteger, WithJsonSchema({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "default": 1})
    ] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[NonEmpty] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Token id (a string, as JSON keys are) -> -100..100 added to its logit; ids beyond the vocabulary
    # get a 400 from the route, which knows the model.
    logit_bias: Annotated[dict[TokenId, Bias] | None, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    # Structured output (docs/structured.md): OpenAI's response_format, llama.cpp's json_schema and grammar.
    response_format: ResponseFormat | None = None
    json_schema: Annotated[dict[str, Any] | None, WithJsonSchema(_JSON_SCHEMA_EXTRA)] = None
    grammar: Annotated[str | None, WithJsonSchema(_GRAMMAR)] = None
    # llama.cpp extras
    top_k: TopK | None = None
    min_p: MinP | None = None
    repeat_penalty: RepetitionPenalty | None = None
    # vLLM's name for the same thing
    repetition_penalty: RepetitionPenalty | None = None
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
    route: RouteMode | None = None
    # vLLM's: a secret of the client's; prefixes are reused only between requests with the same salt (and
    # the same API key), so cached_tokens cannot reveal another client's prompt (serving/cache_scope.py)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise invalid(f"n must be from 1 to {MAX_CHOICES}")
        return n

    @model_validator(mode="after")
    def _one_constraint(self) -> GenerationBody:
        # Which fields ask for a grammar, not the grammar itself: converting one (a 64 KB GBNF grammar takes
        # a fraction of a second) is left to the one parse (server/serving/request.py), off the event loop.
        asked = self.constraint_fields()
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise invalid("response_format.json_schema is required with type json_schema", "response_format")
        if len(asked) > 1:
            raise invalid(
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
        return valid_keep_alive(value)


class ChatCompletionRequest(GenerationBody):
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

    COUNTS: ClassVar[dict[str, int]] = {
        **GenerationBody.COUNTS,
        "messages": MAX_MESSAGES,
        "tools": MAX_TOOLS,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        check_openai_tools(self.tools, self.tool_choice)
        calls = bool(self.tools) and self.tool_choice != "none"
        if calls and self.constraint_fields():
            raise invalid(
                f"{self.constraint_fields()[0]} cannot be combined with tool calls (use tool_choice 'none')",
                self.constraint_fields()[0],
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        return self


_ONE_STRING_LIST = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}
_TOKEN_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_ONE_PROMPT = {
    "anyOf": [
        {"type": "string"},
        _ONE_STRING_LIST,
        _TOKEN_LIST,
        {"type": "array", "items": _TOKEN_LIST, "minItems": 1, "maxItems": 1},
    ],
    "description": "one prompt: text, or token ids of the served model's vocabulary",
}


def _one_prompt(value: Any) -> Any:
    """A prompt as text, a list of one text, token ids, or a list of one list of ids, normalised to text or
    ids (checked here, in one pass: pydantic's union would build an error per id of every other member)."""
    if not isinstance(value, list) or not value or all(isinstance(item, str) for item in value):
        return value  # text, or a list of texts: the type and the count are checked below
    if all(isinstance(item, list) for item in value):
        if len(value) != 1:
            raise invalid("prompt must be one prompt (batches are not supported)", "prompt")
        value = value[0]
        if not value:
            raise invalid("prompt: a list of token ids must not be empty", "prompt")
    return checked_ids(value, "prompt")


class CompletionRequest(GenerationBody):
    COUNTS: ClassVar[dict[str, int]] = {**GenerationBody.COUNTS, "prompt": MAX_TOKEN_IDS}

    prompt: Annotated[Any, BeforeValidator(_one_prompt), WithJsonSchema(_ONE_PROMPT)]
    logprobs: TopLogprobs | None = None
    echo: Annotated[bool, WithJsonSchema({"type": "boolean", "enum": [False], "default": False})] = False
    suffix: Annotated[str | None, WithJsonSchema({"type": ["string", "null"], "maxLength": 0})] = None
    best_of: Annotated[
        AnyInteger | None, WithJsonSchema({"type": ["integer", "null"], "enum": [1, None]})
    ] = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if not isinstance(self.prompt, (str, list)) or (
            isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], (str, int))
        ):
            raise invalid("prompt must be a string, a list of one string, or token ids", "prompt")
        texts = isinstance(self.prompt, list) and (not self.prompt or isinstance(self.prompt[0], str))
        if texts and len(self.prompt) != 1:
            raise invalid("prompt must be one string (batches are not supported)", "prompt")
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise invalid("best_of must be 1", "best_of")
        return self

    def prompt_value(self) -> str | tuple[int, ...]:
        """The prompt's text, or its token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        if isinstance(self.prompt[0], str):
            return self.prompt[0]
        return tuple(self.prompt)


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


def completion_logprobs(events: list[TokenEvent], offset: int = 0) -> dict | None:
    if not events or all(ev.logprob is None for ev in events):
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for ev in events:
        text = token_text(ev)
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


def merged_choices(bodies: list[dict]) -> dict:
    """One reply body of several choices from the bodies of the replies that made them (choice i from the
    i-th): the first body's fields, every choice at its index, completion tokens added up."""
    out = dict(bodies[0])
    out["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    out["usage"] = summed_usage([body["usage"] for body in bodies])
    return out


def summed_usage(usages: list[dict]) -> dict:
    """The usage of a request's choices: the prompt counted once (every choice has the same one), the
    completion tokens added up."""
    usage = dict(usages[0])
    usage["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


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

    def __init__(self, kind: Literal["chat", "text"], rid: str, model: str, index: int = 0) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.index = index  # the choice these chunks carry (OpenAI's n: one builder per choice)
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
                    "index": self.index,
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
            "index": self.index,
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
