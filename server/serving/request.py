"""The internal request: what one generation asks of the server, whatever dialect it came in.

Two stages, as llama.cpp has them. Each dialect turns its validated body into a `Draft` once (its
`translate.py`: simmer's names, nothing defaulted, nothing compiled); `parse` then turns the draft into a
`GenerationRequest` once: the sampling defaults merged, the response grammar and each tool's parameter
grammar converted once. The router, the upstream relay, the worker and the accounting read the
`GenerationRequest` and never a dialect's type.

No pydantic and no HTTP here: frozen dataclasses over models.types.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from models.types import GenerationParams, SamplingParams, Tool, ToolUse

if TYPE_CHECKING:
    from server.serving.grammars import Grammars

Kind = Literal["chat", "text"]
Mode = Literal["local", "auto", "upstream"]  # where a request may be served (routing/decision.py)


@dataclass(frozen=True)
class Show:
    """What the client asked to see; none of it changes the generation."""

    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    governor_events: bool = False  # `event: governor` SSE events


@dataclass(frozen=True)
class ConstraintAsk:
    """The grammar a reply must follow, as asked: a JSON schema (None: any JSON object) or GBNF text, and the
    dialect's own field for it (errors name it: `response_format`, `format`, `text.format`, ...)."""

    kind: Literal["json_schema", "gbnf"]
    source: dict[str, Any] | str | None
    param: str


@dataclass(frozen=True)
class ToolsAsk:
    """The tools a reply may call (tool_choice "none" asks for none: no ToolsAsk)."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required" or a function name
    parallel: bool
    params: tuple[str, ...]  # per tool, the dialect's path of its parameters (errors name it)


@dataclass(frozen=True)
class Asked:
    """The generation fields the client set, in simmer's names. None: not set (defaults are parse's)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k: the chosen token and k alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    truncate: bool = False
    constraint: ConstraintAsk | None = None
    tools: ToolsAsk | None = None


@dataclass(frozen=True)
class Draft:
    """One dialect's request, normalised: the output of its translation, the input of `parse`."""

    kind: Kind
    endpoint: str  # for the log line: "chat", "completions", "api/chat", "api/generate", "responses"
    model: str | None  # as the client named it in simmer's ids (Ollama's ":latest" dropped); None: default
    messages: tuple[dict[str, Any], ...] | None = None  # chat
    prompt: str | tuple[int, ...] | None = None  # text completions: the text, or its token ids
    asked: Asked = field(default_factory=Asked)
    route: Mode | None = None  # the body's route (the X-Simmer-Route header is the flow's)
    keep_alive_s: float | None = None  # parsed; None: SIMMER_KEEP_ALIVE_S
    wait_for_model: bool = False  # no stand-in while its model loads (serving/ladder.py stand_in)
    cache_salt: str | None = None
    show: Show = field(default_factory=Show)
    # The client's explicit generation fields as an OpenAI upstream spells them (name, value); the upstream
    # relay forwards those its allowlist names (server/routing/upstream.py).
    upstream: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Grammar:
    text: str  # the llguidance grammar, converted once
    param: str  # the dialect's field it came from


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    endpoint: str
    model: str | None  # the model that serves it (the router's name for it)
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | tuple[int, ...] | None
    params: GenerationParams  # defaults merged; params.grammar is constraint.text
    constraint: Grammar | None  # the response grammar
    tool_grammars: tuple[Grammar, ...]  # each tool's parameter schema, converted (and checked) once
    route: Mode | None
    keep_alive_s: float | None
    show: Show
    upstream: tuple[tuple[str, Any], ...]
    wait_for_model: bool = False  # the reply waits for its model's load, on no smaller stand-in

    @property
    def payload(self) -> list[dict[str, Any]] | str | tuple[int, ...]:
        """What the engine renders: the chat messages, or the completion prompt (text or token ids)."""
        if self.kind == "chat":
            return list(self.messages or ())
        return self.prompt or ""

    def with_messages(self, messages: list[dict[str, Any]]) -> GenerationRequest:
        """The same request over other messages (the sliding window's summary note in front)."""
        return replace(self, messages=tuple(messages))


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets. OpenAI's own defaults (temperature 1, no
    truncation) let a small model wander into its long tail; llama.cpp's server and Ollama default to a
    truncated distribution, and so does simmer (server/settings.py)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def _either(value: Any, default: Any) -> Any:
    return default if value is None else value


def parse(
    draft: Draft,
    defaults: SamplingDefaults,
    grammars: Grammars,
    *,
    model: str | None = None,
    cache_scope: str = "",
) -> GenerationRequest:
    """The one parse: defaults merged, the response grammar and each tool's parameter grammar converted
    (InvalidParameter naming the dialect's field for what cannot be). CPU work when a grammar is asked:
    off the event loop. `model`: the router's name for the model (the default's id when none was named)."""
    asked = draft.asked
    constraint = None
    if (ask := asked.constraint) is not None:
        if ask.kind == "gbnf":
            text = grammars.gbnf(ask.source if isinstance(ask.source, str) else "", ask.param)
        else:
            text = grammars.json_schema(ask.source if isinstance(ask.source, dict) else None, ask.param)
        constraint = Grammar(text, ask.param)
    tool_grammars: tuple[Grammar, ...] = ()
    tools = None
    if (ta := asked.tools) is not None:
        tool_grammars = tuple(
            Grammar(grammars.json_schema(tool.parameters, param), param)
            for tool, param in zip(ta.tools, ta.params, strict=True)
            if tool.parameters is not None
        )
        tools = ToolUse(ta.tools, ta.choice, ta.parallel)
    sampling = SamplingParams(
        temperature=_either(asked.temperature, defaults.temperature),
        top_p=_either(asked.top_p, defaults.top_p),
        top_k=_either(asked.top_k, defaults.top_k),
        min_p=_either(asked.min_p, defaults.min_p),
        repetition_penalty=asked.repetition_penalty or 1.0,
        presence_penalty=asked.presence_penalty or 0.0,
        frequency_penalty=asked.frequency_penalty or 0.0,
        seed=asked.seed,
        logprobs=asked.logprobs,
        logit_bias=asked.logit_bias,
    )
    params = GenerationParams(
        sampling=sampling,
        max_tokens=asked.max_tokens,
        stop=asked.stop,
        truncate=asked.truncate,
        ignore_eos=asked.ignore_eos,
        grammar=constraint.text if constraint else None,
        tools=tools,
        cache_scope=cache_scope,
    )
    return GenerationRequest(
        kind=draft.kind,
        endpoint=draft.endpoint,
        model=draft.model if model is None else model,
        messages=draft.messages,
        prompt=draft.prompt,
        params=params,
        constraint=constraint,
        tool_grammars=tool_grammars,
        route=draft.route,
        keep_alive_s=draft.keep_alive_s,
        show=draft.show,
        upstream=draft.upstream,
        wait_for_model=draft.wait_for_model,
    )


def check(request: GenerationRequest, grammars: Grammars) -> None:
    """Compile each grammar of the request once (its first mask included): InvalidParameter naming the
    dialect's field for one llguidance refuses. CPU work: off the event loop."""
    for grammar in (*((request.constraint,) if request.constraint else ()), *request.tool_grammars):
        grammars.check(grammar.text, grammar.param)
