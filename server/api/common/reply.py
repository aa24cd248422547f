"""The base of the pydantic models that describe what the server answers (the OpenAPI document is made from
them, and a test validates live replies against them). The dialects build their replies as plain dicts on
the hot path; these models state the shape those dicts have, they are not in the way of every reply.

A field the reply may leave out is `absent()`: not required, and not nullable unless its type says so.
Fields the client did not ask about may follow (an upstream's reply is relayed with its own extras), so
every model allows extra fields; the live-reply test checks that simmer's own replies have none.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt


def _drop_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def absent(description: str | None = None) -> Any:
    """A field that a reply may leave out (never sent as null unless its type allows null)."""
    return Field(default=None, description=description, json_schema_extra=_drop_default)


class Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


ByModel = Annotated[
    dict[str, NonNegativeInt],
    Field(description="which model produced how many tokens (the governor may move a reply to another one)"),
]


class Window(Reply):
    """simmer's sliding-window flags, in every body that ends a reply."""

    truncated: bool = absent("the sliding window dropped turns")
    summarized: bool = absent("dropped turns came as a summary note")


class TopLogprob(Reply):
    """One token's log probability in OpenAI's shape, which Ollama and the Responses API reuse."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
