"""The schemathesis campaign in the suite: every operation of the server's OpenAPI document,
every default check, positive and negative data, at least 1,000 generated requests, against a live
uvicorn serving the tiny real model behind a governor (so the lifecycle route is live).

Two choices keep the run near a minute on two cores, neither of which touches the generated data:
- the governor's table caps every reply at MAX_REPLY tokens at every level (its real `max_tokens` lever),
  so a generated `max_tokens: 10**12` with `ignore_eos` costs a few tokens, not the whole context;
- each case starts in the foreground (a generated `{"state": "background", "client": ...}` is a lease that
  would pause the next ones until it lapses): every lease the server lists is ended by its own client.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

from governor.governor import Governor
from governor.limits import DEFAULT_TABLE, LevelLimits
from models.runtime.engine import load_engine
from server.serving.governor_gate import GovernorGate
from tests.server.conftest import LiveServer, make_settings, start_server

pytestmark = pytest.mark.campaign  # minutes of generated requests: `make test` runs it, `make check` not

MAX_REPLY = 4
EXAMPLES_PER_OPERATION = 80  # hypothesis examples per operation, on top of schemathesis' coverage phase
DIALECT_EXAMPLES = 30  # for the operations of the other dialects (see CONFIG)
MIN_REQUESTS = 1000

CONFIG = SchemathesisConfig.from_dict(
    {
        # A fixed seed, so the suite reruns the same requests; SIMMER_TEST_SCHEMATHESIS_SEED explores others.
        "seed": int(os.environ.get("SIMMER_TEST_SCHEMATHESIS_SEED", "20250611")),
        "generation": {"max-examples": EXAMPLES_PER_OPERATION},
        "output": {"sanitization": {"enabled": False}},  # "max_tokens" is no secret
        "checks": {
            # 413: a schema-valid body can still be over the size limit. A schema-valid prompt can also be
            # longer than the model's context: 400 context_length_exceeded, OpenAI's answer, is right and
            # cannot be expressed in JSON Schema (it counts tokens, not characters): the test lets that
            # 400 through (refused_for_the_model below), not every 400. So is wrong_model_kind: the
            # campaign serves a chat model, which the embedding routes name when `model` is left out.
            "positive_data_acceptance": {"expected-statuses": ["2xx", "404", "413"]},
        },
        # The dialects beside OpenAI's (Ollama's, llama.cpp's tokenizer, Responses) reuse the validation
        # and the generation path the OpenAI operations exercise in full: fewer examples each, so the
        # campaign stays near its old length on two cores.
        "operations": [
            {
                "include-path-regex": "^/(api/|tokenize|detokenize|apply-template|v1/responses)",
                "generation": {"max-examples": DIALECT_EXAMPLES},
            }
        ],
    }
)


def make_gate() -> GovernorGate:
    capped = {
        level: LevelLimits(**{**row.__dict__, "max_tokens": MAX_REPLY})
        for level, row in DEFAULT_TABLE.items()
    }
    return GovernorGate(Governor(table=capped, usable_cpus=1, poll_s=0.05), pause_timeout_s=2.0)


def document() -> dict:
    """The OpenAPI document of an app built as the campaign's server is (with a scripted engine: the
    document does not depend on the model). schemathesis needs it when the tests are collected, before any
    server runs; a test below checks that the live server serves this very document."""
    from server.app import create_app
    from server.settings import Settings
    from tests.server.fakes import ScriptedEngine

    app = create_app(Settings(home=Path("/nonexistent")), engine=ScriptedEngine(), governor=make_gate())
    return app.openapi()


DOCUMENT = document()
# /v1/thermal/events is an endless SSE stream (one event per governor change): it takes no input to fuzz
# and has no response end to validate. Its contract has its own tests.
# /api/pull installs models (it would fetch from PyPI or the Hub for a known name, and convert any GGUF path
# it is given): tests/server/api/test_ollama.py covers it on a tiny local GGUF.
schema = (
    schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)
    .exclude(path="/v1/thermal/events")
    .exclude(path="/api/pull")
)
VOCAB: list[int] = []  # the served model's vocabulary size (its logits), once the server runs
TOKENS: list[int] = []  # its tokenizer's (ids /tokenize and /detokenize know; the logits may be padded)


@schema.hook
def filter_case(context, case) -> bool:
    """Drop the few "schema-valid" cases the server must refuse for reasons the document cannot carry.
    Negative cases are all kept.
    - logit_bias ids (and /tokenize, /detokenize and prompt token ids) at or past the model's vocabulary
      size (the document is per server, not per model; the server answers 400 naming the field, as the
      hostile-input table checks);
    - seeds past the document's own int64 bounds: the generator canonicalises bounds beyond 2**53 through
      float64 (jsonschema_rs) and then draws seeds such as 2**63 + 190 as valid ones;
    - `route: "upstream"`: the campaign's server keeps everything local (SIMMER_ROUTE=local), and says so
      with 403 upstream_not_allowed (tests/server/routing/ checks it); the policy is the server's, not the
      document's."""
    body = case.body
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(body, dict):
        return True
    if body.get("route") == "upstream":
        return False
    prompt = body.get("prompt")  # /v1/completions: ids, or a list of one list of ids
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompt = [i for p in prompt for i in p]
    ids = [*_ints(body.get("tokens")), *_ints(body.get("content")), *_ints(prompt)]  # /detokenize, /tokenize
    if TOKENS and any(i >= TOKENS[0] for i in ids):
        return False
    options = body.get("options")  # Ollama's seed is in its options
    for seed in (body.get("seed"), options.get("seed") if isinstance(options, dict) else None):
        if isinstance(seed, int) and not -(2**63) <= seed < 2**63:
            return False
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and VOCAB and any(int(k) >= VOCAB[0] for k in bias):
        return False
    return not refused_tools_or_schema(body, case.path)


def refused_tools_or_schema(body: dict, path: str = "") -> bool:
    """Tools whose names repeat or that a named tool_choice does not list, and JSON schemas (in
    response_format, json_schema, tools[].function.parameters, and the dialects' format and text.format)
    the constraint library cannot compile (an unimplemented keyword, a $ref to nowhere): the server answers
    400 naming the field, as the hostile-input table and tests/server/api/test_structured.py and
    test_dialect_structured.py check."""
    from pydantic import ValidationError

    from models.errors import InvalidParameter
    from server.api.ollama import translate as ollama
    from server.api.ollama.requests import OllamaChatRequest, OllamaGenerateRequest
    from server.api.openai import translate as openai
    from server.api.openai.requests import ChatCompletionRequest, CompletionRequest
    from server.api.responses import translate as responses
    from server.api.responses.requests import ResponsesRequest
    from server.serving.grammars import LLGUIDANCE
    from server.serving.request import SamplingDefaults, check, parse

    def ours(param: object) -> bool:  # only refusals about these fields are dropped; others still fail
        return str(param).split("[")[0].split(".")[0] in ("tools", "tool_choice", *CONSTRAINTS)

    dialects = {
        "/api/chat": OllamaChatRequest,
        "/api/generate": OllamaGenerateRequest,
        "/v1/responses": ResponsesRequest,
    }
    model = dialects.get(path) or (ChatCompletionRequest if "messages" in body else CompletionRequest)
    try:
        request = model.model_validate(body)
        if isinstance(request, OllamaGenerateRequest):
            draft = ollama.generate_draft(request, as_chat=True) if request.prompt else None
        elif isinstance(request, OllamaChatRequest):
            draft = ollama.chat_draft(request) if request.messages else None
        elif isinstance(request, ResponsesRequest):
            draft = responses.draft(request)
        elif isinstance(request, ChatCompletionRequest):
            draft = openai.chat_draft(request)
        else:
            draft = openai.completion_draft(request)
        if draft is not None:
            check(parse(draft, SamplingDefaults(), LLGUIDANCE), LLGUIDANCE)
    except InvalidParameter as e:
        return ours(e.param)
    except ValidationError as e:
        return all(
            ours(err["loc"][0] if err["loc"] else (err.get("ctx") or {}).get("param")) for err in e.errors()
        )
    return False


CONSTRAINTS = ("response_format", "json_schema", "grammar", "format", "text")


def _ints(value: object) -> list[float]:
    """The numbers of a token list (whole floats are token ids too)."""
    if not isinstance(value, list):
        return []
    return [v for v in value if isinstance(v, int | float) and not isinstance(v, bool)]


class Counter:
    def __init__(self) -> None:
        self.requests = 0
        self.by_status: dict[int, int] = {}
        self.operations: set[str] = set()
        self.lock = threading.Lock()

    def add(self, operation: str, status: int) -> None:
        with self.lock:
            self.requests += 1
            self.operations.add(operation)
            self.by_status[status] = self.by_status.get(status, 0) + 1


COUNTER = Counter()


@pytest.fixture(scope="module")
def campaign_server(tiny_model_dir: Path, tmp_path_factory) -> Iterator[LiveServer]:
    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=256)
    settings = make_settings(tmp_path_factory.mktemp("schemathesis"), model=engine.model_id)
    srv = start_server(settings, engine=engine, governor=make_gate())
    VOCAB[:] = [engine.vocab_size]
    TOKENS[:] = [engine.tokenizer.vocab_size]
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def foreground(campaign_server: LiveServer) -> Iterator[httpx.Client]:
    with campaign_server.client() as client:
        yield client


def reset_lifecycle(client: httpx.Client) -> None:
    """Foreground: end every background lease, each through its own client (the lease API's only way)."""
    reset = client.post("/v1/lifecycle", json={"state": "foreground"})
    assert reset.status_code == 200, reset.text
    state = reset.json()
    for lease in state["leases"]:
        state = client.post("/v1/lifecycle", json={"state": "foreground", "client": lease["client"]}).json()
    assert state["lifecycle"] == "foreground" and not state["leases"], state


@schema.parametrize()
def test_schemathesis_when_generated_requests_then_every_default_check_passes_and_no_5xx(
    case, campaign_server: LiveServer, foreground: httpx.Client
) -> None:
    reset_lifecycle(foreground)
    response = case.call(base_url=campaign_server.url, timeout=30)
    excluded = [positive_data_acceptance] if refused_for_the_model(response) else []
    case.validate_response(response, excluded_checks=excluded)
    COUNTER.add(case.operation.label, response.status_code)
    assert response.status_code < 500, response.text


def refused_for_the_model(response) -> bool:
    """400 context_length_exceeded (OpenAI's shape, or Ollama's with OpenAI's words), or wrong_model_kind
    (a chat model asked for embeddings): refusals the body passed validation to get."""
    if response.status_code != 400:
        return False
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    if isinstance(error, dict):
        return error.get("code") in ("context_length_exceeded", "wrong_model_kind")
    return isinstance(error, str) and (
        error.startswith("This model's maximum context length is") or "it has no embeddings" in error
    )


def test_openapi_when_served_live_then_the_document_the_campaign_used(foreground: httpx.Client) -> None:
    assert foreground.get("/openapi.json").json() == DOCUMENT


def test_schemathesis_campaign_when_run_then_at_least_1000_requests() -> None:
    """Runs after the campaign (file order): every operation ran, it sent enough requests and none got a
    5xx. (Under pytest-xdist the whole file runs in one worker: --dist loadfile.)"""
    if COUNTER.requests == 0:
        pytest.skip("the campaign did not run in this session (deselected)")
    assert COUNTER.operations == {result.ok().label for result in schema.get_all_operations()}
    assert COUNTER.requests >= MIN_REQUESTS, COUNTER.by_status
    assert not [s for s in COUNTER.by_status if s >= 500], COUNTER.by_status
