"""What OpenAI's endpoints answer: the chat completion and its stream chunks, the text completion and its
chunks, the model list and one model (server/api/common/reply.py says what these models are for)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt

from server.api.common.fields import MAX_CHOICES
from server.api.common.reply import ByModel, Reply, TokenLogprob, Window, absent


class ChatLogprobs(Reply):
    content: list[TokenLogprob] | None
    refusal: None


class CompletionLogprobs(Reply):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CachedTokens(Reply):
    cached_tokens: NonNegativeInt


class Usage(Reply):
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    total_tokens: NonNegativeInt
    prompt_tokens_details: CachedTokens = absent()
    models: ByModel = absent()


class Timings(Reply):
    """Like llama.cpp's `timings`: milliseconds and tokens per second."""

    prompt_n: int = absent()
    prompt_ms: float = absent()
    prompt_per_second: float = absent()
    predicted_n: int = absent()
    predicted_ms: float = absent()
    predicted_per_second: float = absent()
    ttft_ms: float = absent()
    draft_n: int = absent("speculative decoding: tokens drafted and verified")
    draft_n_accepted: int = absent("of which accepted")


class RouteReport(Reply):
    """Where the reply was served (local or upstream) and why (docs/routing.md)."""

    served: Literal["local", "upstream"]
    reason: str


class _Timed(Reply):
    timings: Timings = absent()


class Ending(Window, _Timed):
    """What the body that ends a reply carries beside OpenAI's fields (timings, the window flags, route)."""

    route: RouteReport = absent()


class ToolCallFunction(Reply):
    name: str
    arguments: str = Field(description="JSON text (incomplete if cut by length)")


class ToolCall(Reply):
    id: str = Field(pattern="^call_")
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(Reply):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the reply is tool calls only")
    refusal: None
    tool_calls: list[ToolCall] = absent()


class ChatChoice(Reply):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = absent()
    finish_reason: Literal["stop", "length", "tool_calls"]


class _Completion(Reply):
    """What every completion body and stream chunk has: the reply's id, time, model and variant. `object`,
    `choices` and `usage` are declared here for their place in the body (OpenAI's order, which a body
    built from the model keeps), and typed by each reply; the `Ending` fields follow them."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = absent()
    choices: list[Any]
    usage: Any


class ChatCompletion(Ending, _Completion):
    object: Literal["chat.completion"]
    choices: list[ChatChoice] = Field(min_length=1, max_length=MAX_CHOICES)  # the request's n
    usage: Usage


class ChunkFunction(Reply):
    name: str = absent()
    arguments: str


class ChunkToolCall(Reply):
    """A call's first chunk carries its id, type and name; later ones only arguments."""

    index: int
    id: str = absent()
    type: Literal["function"] = absent()
    function: ChunkFunction


class ChunkDelta(Reply):
    role: Literal["assistant"] = absent()
    content: str | None = absent()
    tool_calls: list[ChunkToolCall] = absent()


class ChunkChoice(Reply):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = absent()
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(Ending, _Completion):
    """One `data:` of a chat stream. The last chunk with choices has the finish_reason and simmer's
    fields; with stream_options.include_usage a last one follows with no choices and the usage."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChunkChoice] = Field(max_length=1)
    usage: Usage | None = absent()


class TextChoice(Reply):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = absent()
    finish_reason: Literal["stop", "length"]


class TextCompletion(Ending, _Completion):
    object: Literal["text_completion"]
    choices: list[TextChoice] = Field(min_length=1, max_length=MAX_CHOICES)  # the request's n
    usage: Usage


class TextChunkChoice(Reply):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = absent()
    finish_reason: Literal["stop", "length"] | None


class TextCompletionChunk(Ending, _Completion):
    """One `data:` of a text completion stream (as OpenAI's, its object is `text_completion` too)."""

    object: Literal["text_completion"]
    choices: list[TextChunkChoice] = Field(max_length=1)
    usage: Usage | None = absent()


class Model(Reply):
    """A model as /v1/models lists it; after OpenAI's four fields, simmer's (measured at pull time on this
    machine: the variants' quality against the fp32 reference and their speed)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    default: bool = absent("the model a request that names none gets")
    variants: list[str] = absent()
    variant: str | None = absent()
    disk_bytes: int | None = absent()
    context_length: int | None = absent()
    max_context_length: int | None = absent()
    can_chat: bool = absent()
    kind: Literal["generation", "embedding"] = absent(
        "what the model does (an embedding model: /v1/embeddings)"
    )
    loaded: bool = absent()
    keep_alive_s: float | None = absent("seconds until an idle loaded model unloads (null: kept)")
    resident_bytes_estimate: int | None = absent()
    ladder_rungs: list[str] = absent()
    variant_quality: dict[str, dict[str, float | None]] = absent()
    quality_floor: dict[str, Any] | None = absent()
    refused_variants: dict[str, str] = absent()
    remote: bool = absent("served only by the upstream (docs/routing.md)")


class ModelList(Reply):
    object: Literal["list"]
    data: list[Model]
