"""Replies built as their models (server/api/common/reply.py's `wire`): a field left unset is absent, one
set to None is null, and the fields go out in the order the bodies had them when they were dicts (the
order OpenAI's and Ollama's own servers send)."""

from __future__ import annotations

import json

from models.types import FinishEvent, Timings, TokenEvent, TopLogprob, Usage
from server.api.common.reply import wire
from server.api.ollama.render import final, piece
from server.api.openai.render import ChunkBuilder, chat_completion

TOKEN = TokenEvent(5, "hé", 0, logprob=-0.5, top_logprobs=(TopLogprob("a", -1.0, [97]),))
FINISH = FinishEvent("length", Usage(3, 1, by_model={"m": 1}), Timings(prompt_ms=1.23456), truncated=True)


def keys(text: str) -> list[str]:
    return list(json.loads(text))


def test_chunk_when_built_then_null_where_set_none_and_absent_where_unset():
    builder = ChunkBuilder("chat", "chatcmpl-1", "m")
    opening, text = (json.loads(wire(c)) for c in builder.delta("hé", [TOKEN]))
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert opening["system_fingerprint"] is None and "usage" not in opening and "timings" not in opening
    assert text["choices"][0]["delta"] == {"content": "hé"}
    assert text["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "a", "logprob": -1.0, "bytes": [97]}
    ]


def test_chat_completion_when_built_then_its_fields_in_the_body_order():
    body = wire(chat_completion("chatcmpl-1", "m", "hé", [TOKEN], FINISH, "q4"))
    assert keys(body) == [
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "usage",
        "timings",
        "truncated",
        "summarized",
    ]
    assert list(json.loads(body)["usage"]) == [
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
        "models",
    ]
    assert json.loads(body)["timings"]["prompt_ms"] == 1.235


def test_ollama_lines_when_built_then_their_fields_in_the_body_order():
    stats = {"total_duration": 2, "load_duration": 1, "prompt_eval_count": 3}
    assert keys(wire(piece("chat", "m", "hé", []))) == ["model", "created_at", "message", "done"]
    assert keys(wire(final("generate", "m", "", [TOKEN], FINISH, stats))) == [
        "model",
        "created_at",
        "response",
        "done",
        "logprobs",
        "done_reason",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "truncated",
        "summarized",
        "eval_count_by_model",
    ]
