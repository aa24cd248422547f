"""Ollama's request bodies on the wire (https://github.com/ollama/ollama/blob/main/docs/api.md).

Requests are validated here; translate.py turns /api/chat and /api/generate bodies into the internal
request (what each option becomes is listed there). options.num_ctx, repeat_last_n and Ollama's runner
options (num_thread, num_gpu, mirostat, ...) are accepted and not applied: the context is the server's
(SIMMER_CONTEXT_LENGTH, lowered by the governor), the repetition penalty covers the whole history. Unknown
options are ignored, as Ollama ignores them; both are logged at debug. Tools follow OpenAI's rules, named in
OpenAI's paths (Ollama's tools are OpenAI's); a schema llguidance cannot read is refused naming `format`. A
reply's calls come back as Ollama's message.tool_calls, each whole once its arguments object is
(`CallCollector`).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from server.api.common.fields import (
    MAX_INPUTS,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
    SCHEMA_OBJECT,
    STRICT,
    AnyInteger,
    ContextLength,
    FunctionName,
    MinP,
    NonEmpty,
    Penalty,
    RepetitionPenalty,
    RouteMode,
    Seed,
    StrictBody,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    invalid,
    valid_keep_alive,
)
from server.api.common.names import model_id
from server.api.common.tools import NamedToolChoice, ToolSpec, check_openai_tools
from server.serving.embedding import MAX_EMBED_INPUTS
from server.serving.keep_alive import PATTERN as KEEP_ALIVE_PATTERN
from server.serving.keep_alive import parse_keep_alive

log = logging.getLogger("simmer.ollama")

NOT_APPLIED = ("num_ctx", "repeat_last_n")  # known to simmer, accepted, not applied (see above)


class OllamaOptions(StrictBody):
    """`options`: the sampling fields simmer applies, typed as Ollama types them; the rest is accepted."""

    model_config = ConfigDict(**{**STRICT, "extra": "allow"})
    COUNTS: ClassVar[dict[str, int]] = {"stop": MAX_STOP}

    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    num_predict: AnyInteger | None = None  # -1 and -2 mean something (no cap)
    seed: Seed | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    num_ctx: ContextLength | None = None
    repeat_last_n: AnyInteger | None = None

    def log_unapplied(self) -> None:
        names = [n for n in NOT_APPLIED if getattr(self, n) is not None] + sorted(self.model_extra or {})
        if names:
            log.debug("options accepted but not applied: %s", ", ".join(names))


Think = bool | Literal["low", "medium", "high", "max"]


def _refused(schema: dict[str, Any], why: str) -> Any:
    """A field accepted on the wire but refused (until a feature lands): the published schema allows only
    the values that are served, and says why."""
    return WithJsonSchema({**schema, "description": why})


_NONE: dict[str, Any] = {"type": ["array", "null"], "maxItems": 0}
_FORMAT = {
    "anyOf": [{"enum": ["", "json", None]}, {**SCHEMA_OBJECT, "type": "object"}],
    "description": '"json" (any JSON object) or a JSON schema the reply follows (docs/structured.md)',
}
_KEEP_ALIVE = {
    "anyOf": [{"type": "number"}, {"type": "string", "pattern": KEEP_ALIVE_PATTERN}, {"type": "null"}],
    "description": '"5m", "1h30m", seconds (a number), 0 (unload after), negative (for ever)',
}


def _model_required(**extra: Any) -> ConfigDict:
    """`model` is required (the published schema says so; a missing one is Ollama's "model is required")."""

    def schema(doc: dict[str, Any]) -> None:
        doc["required"] = sorted({*doc.get("required", []), "model"})
        doc.update(extra)

    return ConfigDict(json_schema_extra=schema)


class OllamaTurn(StrictBody):
    """Fields /api/chat and /api/generate share."""

    model_config = _model_required()

    model: Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})] = ""
    stream: bool = True  # Ollama streams unless told not to
    format: Annotated[Any, WithJsonSchema(_FORMAT)] = None
    options: OllamaOptions | None = None
    keep_alive: Annotated[int | float | str | None, WithJsonSchema(_KEEP_ALIVE)] = None
    think: Annotated[Think | None, _refused({"enum": [False, None]}, "the served model does not think")] = (
        None
    )
    truncate: bool | None = None
    shift: bool | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    route: RouteMode | None = None  # simmer's: where to serve it (or the X-Simmer-Route header)

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, value: float | str | None) -> float | str | None:  # int | float: any JSON number
        return valid_keep_alive(value)

    @model_validator(mode="after")
    def _supported(self) -> OllamaTurn:
        if not self.model:
            raise invalid("model is required", "model")
        if self.format not in (None, "", "json") and not isinstance(self.format, dict):
            raise invalid('format must be "json" or a JSON schema (an object)', "format")
        if self.think not in (None, False):
            raise invalid(f"{self.model!r} does not support thinking", "think")
        return self

    @property
    def model_id(self) -> str:
        return model_id(self.model)

    def keep_alive_s(self) -> float | None:
        return parse_keep_alive(self.keep_alive)


class OllamaCalledFunction(BaseModel):
    model_config = STRICT

    index: AnyInteger | None = None
    name: FunctionName
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, as Ollama sends it back


class OllamaToolCall(BaseModel):
    """A call an earlier assistant turn made (as Ollama's reply had it)."""

    model_config = STRICT

    id: str | None = None
    function: OllamaCalledFunction


class OllamaMessage(StrictBody):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: Annotated[list[str] | None, _refused(_NONE, "the served model reads text only")] = None
    tool_calls: list[OllamaToolCall] | None = None  # assistant turns that called tools
    tool_name: str | None = None  # a tool turn: the function it answers for
    tool_call_id: str | None = None  # a tool turn: the call it answers
    thinking: str | None = None  # a previous turn's reasoning: no part of the prompt

    @model_validator(mode="after")
    def _text_only(self) -> OllamaMessage:
        if self.images:
            raise invalid("images are not supported: the served model reads text only", "images")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI chat message: calls with their arguments as JSON text, as OpenAI sends them."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


_WITH_TOOLS = {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}


class OllamaChatRequest(OllamaTurn):
    COUNTS: ClassVar[dict[str, int]] = {"messages": MAX_MESSAGES, "tools": MAX_TOOLS}
    # tool_choice needs tools; format with tools is refused (the reply is a call or the format)
    model_config = _model_required(
        allOf=[
            {
                "if": {"properties": {"tool_choice": {"not": {"type": "null"}}}, "required": ["tool_choice"]},
                "then": _WITH_TOOLS,
            },
            {"if": _WITH_TOOLS, "then": {"properties": {"format": {"enum": ["", None]}}}},
        ]
    )

    messages: list[OllamaMessage] = Field(default_factory=list)  # empty: load (or unload) the model
    tools: list[ToolSpec] | None = None  # OpenAI's shape; the model calls them when it sees fit ("auto")
    # simmer's extra (Ollama has none): force a call ("required", a function) or hide the tools ("none")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _tools_supported(self) -> OllamaChatRequest:
        if self.tools and self.format not in (None, ""):
            raise invalid(
                "format cannot be combined with tools: the reply is either a tool call or the format",
                "format",
            )
        if self.messages:  # a load request's tools are not looked at
            check_openai_tools(self.tools, self.tool_choice)
        return self


_EMPTY = {"type": "string", "maxLength": 0}


class OllamaGenerateRequest(OllamaTurn):
    # raw mode takes no system message (the prompt is sent as written), as in Ollama
    model_config = _model_required(
        **{
            "if": {"properties": {"raw": {"const": True}}, "required": ["raw"]},
            "then": {"properties": {"system": {"maxLength": 0}}},
        }
    )

    COUNTS: ClassVar[dict[str, int]] = {"context": MAX_TOKEN_IDS, "images": MAX_INPUTS}

    prompt: str = ""  # empty: load (or unload) the model
    suffix: Annotated[str, _refused(_EMPTY, "fill in the middle is not supported")] = ""
    system: str = ""
    template: Annotated[str, _refused(_EMPTY, "Go templates are not supported; use raw: true")] = ""
    context: Annotated[list[AnyInteger] | None, _refused(_NONE, "deprecated in Ollama; use /api/chat")] = None
    raw: bool = False
    images: Annotated[list[str] | None, _refused(_NONE, "the served model reads text only")] = None

    @model_validator(mode="after")
    def _generate_supported(self) -> OllamaGenerateRequest:
        if self.images:
            raise invalid("images are not supported: the served model reads text only", "images")
        if self.suffix:
            raise invalid("suffix (fill in the middle) is not supported", "suffix")
        if self.template:
            raise invalid(
                "template (a Go template) is not supported: simmer renders the model's own chat template; "
                "send raw: true with a prompt you formatted",
                "template",
            )
        if self.context:
            # Deprecated in Ollama, and simmer's replies carry none to send back.
            raise invalid(
                "context (deprecated in Ollama) is not supported: send the conversation to /api/chat",
                "context",
            )
        if self.raw and self.system:
            raise invalid("raw mode does not support template, system, or context", "system")
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.prompt}]

    def plain_text(self) -> str:
        """A base model (no chat template) continues the text, system first, as `ollama run` does."""
        return "\n".join(t for t in (self.system, self.prompt) if t)


class ModelRequest(StrictBody):
    """/api/show, /api/delete, /api/pull: `model` (older clients send `name`)."""

    # one of the two, not empty
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["model"], "properties": {"model": {"minLength": 1}}},
                {"required": ["name"], "properties": {"name": {"minLength": 1}}},
            ]
        }
    )

    model: str = ""
    name: str = ""

    @model_validator(mode="after")
    def _named(self) -> ModelRequest:
        if not (self.model or self.name):
            raise invalid("model is required", "model")
        return self

    @property
    def model_id(self) -> str:
        return model_id(self.model or self.name)

    @property
    def given(self) -> str:
        return self.model or self.name


class ShowRequest(ModelRequest):
    verbose: bool = False


class PullRequest(ModelRequest):
    stream: bool = True
    insecure: bool = False  # Ollama's registry option; simmer's sources verify their hashes either way


class EmbedRequest(StrictBody):
    """/api/embed (`input`) and the legacy /api/embeddings (`prompt`); server/api/ollama/embeddings.py."""

    model_config = _model_required()

    COUNTS: ClassVar[dict[str, int]] = {"input": MAX_EMBED_INPUTS}

    model: Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})] = ""
    input: str | list[str] | None = None
    prompt: str | None = None
    # Ollama's default: an input over the context is cut to fit; false refuses it (a 400)
    truncate: bool = True
    # how long the embedding model stays open after the request (0 closes it at once; negative keeps it)
    keep_alive: Annotated[int | float | str | None, WithJsonSchema(_KEEP_ALIVE)] = None
    options: OllamaOptions | None = None  # accepted as Ollama does; an encoder samples nothing
    route: RouteMode | None = None  # simmer's: where to serve it (or the X-Simmer-Route header)

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, value: float | str | None) -> float | str | None:
        return valid_keep_alive(value)

    @model_validator(mode="after")
    def _named(self) -> EmbedRequest:
        if not self.model:
            raise invalid("model is required", "model")
        return self

    def keep_alive_s(self) -> float | None:
        return parse_keep_alive(self.keep_alive)


# ---- replies ------------------------------------------------------------------------------------------
