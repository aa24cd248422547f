"""What the request schema accepts, the sampler handles, and what it refuses, the sampler would refuse too:
every sampling field over its whole published range (bounds read from the JSON schema the server
publishes), on random logits that include -inf and huge values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pydantic import ValidationError

from models.errors import InvalidParameter
from models.runtime.sampling import Sampler, make_rng, validate
from server.api.openai.requests import ChatCompletionRequest
from server.api.openai.translate import chat_draft
from server.serving.grammars import LLGUIDANCE
from server.serving.request import SamplingDefaults, parse

FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
]
PROPERTIES = ChatCompletionRequest.model_json_schema()["properties"]
MSG = [{"role": "user", "content": "hi"}]


def bounds(name: str) -> tuple[dict, bool]:
    """The non-null branch of a field's published schema, and whether it is an integer."""
    branch = next(b for b in PROPERTIES[name]["anyOf"] if b.get("type") != "null")
    return branch, branch["type"] == "integer"


def accepted(name: str) -> st.SearchStrategy:
    branch, integer = bounds(name)
    low = branch.get("minimum", branch.get("exclusiveMinimum"))
    high = branch.get("maximum", branch.get("exclusiveMaximum"))
    if integer:
        if "exclusiveMaximum" in branch:
            high -= 1
        return st.integers(low, high) | st.sampled_from([v for v in (low, high) if v is not None])
    finite = st.floats(
        low,
        high,
        exclude_min="exclusiveMinimum" in branch,
        exclude_max="exclusiveMaximum" in branch,
        allow_nan=False,
    )
    # the bounds themselves and the floats just inside them
    edges = [low, high, float(np.nextafter(low, high)), float(np.nextafter(high, low))]
    return finite | st.sampled_from(edges)


def refused(name: str) -> list:
    branch, integer = bounds(name)
    out: list = ["1", True, math.nan, math.inf]
    step = 1 if integer else 1e-9
    if "minimum" in branch:
        out.append(branch["minimum"] - step)
    if "maximum" in branch:
        out.append(branch["maximum"] + step)
    if "exclusiveMaximum" in branch:
        out.append(branch["exclusiveMaximum"])
    if not integer:
        out += [
            float(np.nextafter(branch["minimum"], -math.inf)),
            float(np.nextafter(branch["maximum"], math.inf)),
        ]
    return out


logits = hnp.arrays(
    np.float32,
    st.integers(1, 40),
    elements=st.floats(width=32, allow_nan=False) | st.sampled_from([-np.inf, 3.4e38, 0.0]),
)


@pytest.mark.parametrize("name", FIELDS)
def test_schema_when_field_in_its_published_range_then_sampler_takes_it_and_returns_a_token(
    name: str,
) -> None:
    @settings(max_examples=80, deadline=None)
    @given(accepted(name), logits)
    def check(value, x: np.ndarray) -> None:
        draft = chat_draft(ChatCompletionRequest(messages=MSG, **{name: value}))
        params = parse(draft, SamplingDefaults(), LLGUIDANCE).params.sampling
        validate(params, vocab_size=x.shape[0])
        token, _, _ = Sampler(params, make_rng(params.seed)).sample(x, [0])
        assert 0 <= token < x.shape[0]

    check()


@pytest.mark.parametrize("name", FIELDS)
def test_schema_when_field_outside_its_published_range_then_400_before_the_sampler(name: str) -> None:
    for value in refused(name):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=MSG, **{name: value})


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"])
def test_sampler_when_value_outside_the_schema_range_then_it_refuses_it_too(name: str) -> None:
    branch, _ = bounds(name)
    from models.types import SamplingParams

    for value in (branch["minimum"] - 1e-6, branch["maximum"] + 1e-6):
        with pytest.raises(InvalidParameter):
            validate(SamplingParams(**{name: value}))
