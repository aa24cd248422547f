"""llama.cpp server's /tokenize, /detokenize and /apply-template (server/wire/llamacpp.py has the JSON).

The tokenizer is read-only and lives with the engine: these run in a thread of the threadpool, not on the
worker (so they do not queue behind a generation, as llama.cpp answers them while its slots are busy) and
not on the event loop (a long text takes a while to tokenize).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from models.errors import InvalidParameter, ModelNotFound
from models.protocol import Engine
from server.errors import ModelLoading
from server.wire.llamacpp import ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest, tokens_json

if TYPE_CHECKING:
    from server.app import Runtime

router = APIRouter()


def served_engine(request: Request, model: str | None) -> Engine:
    """The engine of the served model `model` names (any, when it names none)."""
    rt: Runtime = request.app.state.runtime
    if model and model not in rt.served_ids():
        raise ModelNotFound(
            f"The model '{model}' is not served here; this server serves '{rt.model_id()}'", param="model"
        )
    engine = rt.worker.engine
    if engine is None:
        raise ModelLoading("The model is still loading; retry shortly")
    return engine


def _check_ids(engine: Engine, ids: list[int], param: str) -> list[bytes]:
    """Each id's bytes; an id outside the vocabulary is a 400 naming its position."""
    out = []
    for i, token in enumerate(ids):
        try:
            out.append(engine.token_bytes(token))
        except (IndexError, OverflowError, ValueError):
            raise InvalidParameter(
                f"{param}[{i}]: {token} is not a token id of this model's vocabulary", param=f"{param}[{i}]"
            ) from None
    return out


def _tokenize(engine: Engine, body: TokenizeRequest) -> dict[str, Any]:
    parts = [body.content] if isinstance(body.content, str) else body.content
    ids: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            # BOS (add_special) only in front of the first text, as llama.cpp's tokenize_mixed does
            ids += engine.tokenize(
                part, add_special=body.add_special and i == 0, parse_special=body.parse_special
            )
        else:
            _check_ids(engine, [part], f"content[{i}]")
            ids.append(part)
    pieces = [engine.token_bytes(t) for t in ids] if body.with_pieces else None
    return tokens_json(ids, pieces)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    engine = served_engine(request, body.model)
    return await asyncio.to_thread(_tokenize, engine, body)


def _detokenize(engine: Engine, ids: list[int]) -> dict[str, str]:
    data = b"".join(_check_ids(engine, ids, "tokens"))
    return {"content": data.decode("utf-8", errors="replace")}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    engine = served_engine(request, body.model)
    return await asyncio.to_thread(_detokenize, engine, body.tokens)


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> dict[str, str]:
    engine = served_engine(request, body.model)
    return {"prompt": await asyncio.to_thread(engine.chat_text, body.message_dicts())}
