"""Internal requests for tests that drive the router or the worker directly: built from an OpenAI body
through the real translation and parse, as the route builds them."""

from __future__ import annotations

from typing import Any

from server.api.openai.requests import ChatCompletionRequest, CompletionRequest
from server.api.openai.translate import chat_draft, completion_draft
from server.serving.grammars import LLGUIDANCE
from server.serving.request import GenerationRequest, SamplingDefaults, parse

HI = [{"role": "user", "content": "hi"}]


def chat_request(**body: Any) -> GenerationRequest:
    """/v1/chat/completions' request for this body (messages: one "hi" unless given)."""
    validated = ChatCompletionRequest.model_validate({"messages": HI, **body})
    return parse(chat_draft(validated), SamplingDefaults(), LLGUIDANCE)


def text_request(**body: Any) -> GenerationRequest:
    """/v1/completions' request for this body (prompt: "hi" unless given)."""
    validated = CompletionRequest.model_validate({"prompt": "hi", **body})
    return parse(completion_draft(validated), SamplingDefaults(), LLGUIDANCE)
