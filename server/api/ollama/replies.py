"""What Ollama's endpoints answer: /api/chat and /api/generate (one body, or one NDJSON line each), a pull's
progress, /api/tags and /api/ps, /api/show and /api/version (server/api/common/reply.py says what these
models are for). Errors are Ollama's `{"error": "message"}` (server/http/error_bodies.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import NonNegativeInt

from server.api.common.reply import ByModel, Reply, TopLogprob, Window, absent


class OllamaLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = absent()


class OllamaCallFunction(Reply):
    index: int
    name: str
    arguments: dict[str, Any]


class OllamaCall(Reply):
    """A call whose arguments object is complete (Ollama sends calls whole)."""

    id: str
    function: OllamaCallFunction


class OllamaReplyMessage(Reply):
    role: str
    content: str
    tool_calls: list[OllamaCall] = absent()


class _Line(Reply):
    """What every line begins with: the model that produced it and when."""

    model: str
    created_at: str


class _ChatLine(_Line):
    message: OllamaReplyMessage


class _GenerateLine(_Line):
    response: str


class _Stats(Reply):
    done: bool
    logprobs: list[OllamaLogprob] = absent()
    done_reason: Literal["stop", "length", "load", "unload"] = absent()
    total_duration: NonNegativeInt = absent()
    load_duration: NonNegativeInt = absent()
    prompt_eval_count: NonNegativeInt = absent()
    prompt_eval_duration: NonNegativeInt = absent()
    eval_count: NonNegativeInt = absent()
    eval_duration: NonNegativeInt = absent()


class _Ending(Window, _Stats):
    """One reply (stream: false), or one NDJSON line of a stream; the last has done: true, done_reason,
    the statistics (nanoseconds) and the window flags. Declared after the line's head (model, created_at,
    the text), in the order Ollama sends them, which a line built from the model keeps."""

    eval_count_by_model: ByModel = absent()


class OllamaChat(_Ending, _ChatLine):
    pass


class OllamaGenerate(_Ending, _GenerateLine):
    pass


class OllamaProgress(Reply):
    """A pull's progress (one NDJSON line), or its result when not streamed."""

    status: str
    digest: str = absent()
    total: int = absent()
    completed: int = absent()


class OllamaDetails(Reply):
    parent_model: str = absent()
    format: str = absent()
    family: str | None = absent()
    families: list[str] | None = absent()
    parameter_size: str = absent()
    quantization_level: str = absent()


class OllamaModel(Reply):
    """An installed model (/api/tags) or one in memory (/api/ps: size_vram, expires_at, context_length)."""

    name: str
    model: str
    modified_at: str = absent()
    size: NonNegativeInt
    digest: str
    remote_host: str = absent("served only by the upstream")
    details: OllamaDetails
    capabilities: list[str] = absent("what the model does: embedding, or completion (and tools)")
    size_vram: NonNegativeInt = absent()
    expires_at: str = absent()
    context_length: int | None = absent()


class OllamaModels(Reply):
    """/api/tags (installed models) and /api/ps (models in memory)."""

    models: list[OllamaModel]


class OllamaShow(Reply):
    modelfile: str = absent()
    parameters: str = absent()
    template: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str = absent()


class OllamaVersion(Reply):
    version: str
    simmer: str = absent()
