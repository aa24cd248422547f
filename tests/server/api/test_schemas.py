"""OpenAI's wire models, translated once and parsed once, give the engine's params; unsupported requests fail
validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from models.types import GenerationParams
from server.api.openai.requests import ChatCompletionRequest, CompletionRequest
from server.api.openai.translate import chat_draft, completion_draft
from server.serving.grammars import LLGUIDANCE
from server.serving.request import SamplingDefaults, parse

MSG = [{"role": "user", "content": "hi"}]


def params(req: ChatCompletionRequest | CompletionRequest, defaults=SamplingDefaults()) -> GenerationParams:
    draft = chat_draft(req) if isinstance(req, ChatCompletionRequest) else completion_draft(req)
    return parse(draft, defaults, LLGUIDANCE).params


def test_chat_request_when_openai_fields_then_mapped_to_generation_params() -> None:
    req = ChatCompletionRequest(
        messages=MSG,
        max_completion_tokens=7,
        max_tokens=99,
        temperature=0.2,
        top_p=0.9,
        stop="END",
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=2,
        top_k=40,
        min_p=0.05,
        repeat_penalty=1.1,
        truncate=True,
        ignore_eos=True,
    )
    p = params(req)
    assert p.ignore_eos is True
    assert p.max_tokens == 7  # max_completion_tokens wins over the legacy max_tokens
    assert p.stop == ("END",)
    assert p.truncate is True
    s = p.sampling
    assert (s.temperature, s.top_p, s.seed, s.top_k, s.min_p) == (0.2, 0.9, 3, 40, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.logprobs == 2


def test_chat_request_when_defaults_then_openai_defaults() -> None:
    p = params(ChatCompletionRequest(messages=MSG))
    assert p.max_tokens is None and p.stop == () and p.sampling.logprobs is None
    assert p.sampling.temperature == 1.0 and p.sampling.repetition_penalty == 1.0


def test_chat_request_when_content_parts_then_joined_text() -> None:
    req = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]
    )
    assert chat_draft(req).messages == ({"role": "system", "content": "ab"},)


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 9},
        {"temperature": 3},
        {"tools": [{"type": "function"}]},
        {"top_logprobs": 2},
        {"stop": ["", "x"]},
    ],
)
def test_chat_request_when_unsupported_then_validation_error(extra: dict) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=MSG, **extra)


def test_completion_request_when_list_prompt_and_logprobs_then_mapped() -> None:
    req = CompletionRequest(prompt=["Once"], logprobs=3, stop=["a", "b"], repetition_penalty=1.2)
    p = params(req)
    assert completion_draft(req).prompt == "Once"
    assert p.sampling.logprobs == 3 and p.stop == ("a", "b") and p.sampling.repetition_penalty == 1.2


@pytest.mark.parametrize("extra", [{"prompt": ["a", "b"]}, {"echo": True}, {"best_of": 2}])
def test_completion_request_when_unsupported_then_validation_error(extra: dict) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(**{"prompt": "x", **extra})


def test_request_when_sampling_fields_left_out_then_given_defaults_apply_and_sent_values_win() -> None:
    llama = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)
    s = params(ChatCompletionRequest(messages=MSG), llama).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.8, 0.95, 40, 0.05)
    sent = ChatCompletionRequest(messages=MSG, temperature=0, top_p=1, top_k=0, min_p=0)
    s = params(sent, llama).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.0, 1.0, 0, 0.0)
