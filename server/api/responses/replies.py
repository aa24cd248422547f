"""What OpenAI's Responses endpoint answers: the `response` object, the same in the reply and in the stream's
events (server/api/common/reply.py says what these models are for). A stream's events are OpenAI's
(`response.created`, `response.output_text.delta`, ...), each with the `response` or the item it concerns."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt

from server.api.common.reply import ByModel, Reply, TokenLogprob, Window, absent

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Reply):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]


class OutputMessage(Reply):
    id: str
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(Reply):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str
    name: str
    arguments: str = Field(description="JSON text (incomplete if cut by max_output_tokens)")


class InputTokensDetails(Reply):
    cached_tokens: NonNegativeInt
    cache_write_tokens: NonNegativeInt = Field(description="prompt tokens prefilled now, kept in the cache")


class OutputTokensDetails(Reply):
    reasoning_tokens: NonNegativeInt


class ResponseUsage(Reply):
    input_tokens: NonNegativeInt
    input_tokens_details: InputTokensDetails = absent()
    output_tokens: NonNegativeInt
    output_tokens_details: OutputTokensDetails = absent()
    total_tokens: NonNegativeInt
    models: ByModel = absent("output tokens per model, as chat's usage.models")


class IncompleteDetails(Reply):
    reason: str


class ResponseError(Reply):
    code: str
    message: str


class ResponseTextConfig(Reply):
    format: dict[str, Any]


class _ResponseBody(Reply):
    """The response's fields in the order OpenAI sends them; `Response` adds simmer's and the last two."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None = absent()
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: ResponseError | None = absent()
    incomplete_details: IncompleteDetails | None = absent()
    model: str = Field(
        description="the model producing the reply (finished: the one that finished it); the governor may "
        "place a reply on a smaller model or move it to another mid-way"
    )
    instructions: str | None = absent()
    output: list[Annotated[OutputMessage | FunctionCallItem, Field(discriminator="type")]]
    parallel_tool_calls: bool = absent()
    previous_response_id: None = absent()
    tool_choice: str | dict[str, Any] = absent()
    tools: list[dict[str, Any]] = absent()
    temperature: float | None = absent()
    top_p: float | None = absent()
    top_logprobs: int | None = absent()
    max_output_tokens: int | None = absent()
    truncation: str = absent()
    text: ResponseTextConfig = absent()
    reasoning: None = absent()
    store: Literal[False] = absent("nothing is stored, whatever `store` asked")
    background: bool = absent()
    metadata: dict[str, str] = absent()
    service_tier: str = absent()
    safety_identifier: str | None = absent()
    prompt_cache_key: str | None = absent()


class Response(Window, _ResponseBody):
    """The window flags come once the reply ended (completed, incomplete)."""

    user: str = absent()
    usage: ResponseUsage | None = absent()
