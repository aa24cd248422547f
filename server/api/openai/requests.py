"""OpenAI's request bodies on the wire (/v1/chat/completions, /v1/completions), validated here and translated
once into the internal request (translate.py). Nothing outside the dialect folders sees these types (the
router and the worker take a GenerationRequest)."""

from __future__ import annotations

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
from server.api.common.messages import ChatMessage
from server.api.common.tools import (
    NamedToolChoice,
    ToolSpec,
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
    # while the model loads, no smaller model of the ladder starts the reply in its place: it waits
    wait_for_model: bool = False
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
