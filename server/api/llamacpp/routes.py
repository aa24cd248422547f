"""llama.cpp server's /tokenize, /detokenize, /apply-template and /embedding (server/api/llamacpp/requests.py
has the JSON).

/embedding (and /embeddings, its alias in llama.cpp) shares the embedding path of every dialect
(server/api/common/embeddings.py): it runs on the worker, as the other dialects' embeddings do.

The tokenizer is read-only and needs no weights: these run on a thread of their own (serving/tokenizers.py),
not on the worker (so they do not queue behind a generation, as llama.cpp answers them while its slots are
busy) and not on the event loop (a long text takes a while to tokenize, and its JSON a while to write).
The model they are asked about answers with its engine when it is loaded, else with its tokenizer alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response

from models.errors import InvalidParameter, ModelNotFound
from server.api.common.embeddings import embed, embedding_target
from server.api.common.reply import Reply, wire
from server.api.llamacpp.embeddings import check_normalize, embedding_body
from server.api.llamacpp.render import applied, detokenized, tokens_reply
from server.api.llamacpp.replies import Detokenized, Tokens
from server.api.llamacpp.requests import (
    ApplyTemplateRequest,
    DetokenizeRequest,
    LlamaEmbeddingRequest,
    TokenizeRequest,
)
from server.refusals import ModelLoading
from server.serving.catalog import CatalogEntry
from server.serving.tokenizers import TextSide, give_back_if_large

if TYPE_CHECKING:
    from server.api.context import Runtime

router = APIRouter()


def _target(rt: Runtime, model: str | None) -> TextSide | CatalogEntry:
    """The loaded engine of the model `model` names (none named: the default model, as a generation
    request means), or its catalog entry when it is not loaded (its tokenizer is read from there)."""
    entry = rt.served.resolve(model)
    if entry is None:
        raise ModelNotFound(
            f"The model '{model or rt.model}' is not served here; this server serves '{rt.model}'",
            param="model",
        )
    engine = rt.served.pool.engine(entry.id) or rt.served.pool.kept(entry.id)
    if engine is not None:
        return engine
    if entry.path is None:  # an engine handed over by a factory that has not returned yet
        raise ModelLoading("The model is still loading; retry shortly")
    return entry


async def _answer(
    request: Request, model: str | None, work: Callable[[TextSide], Reply], size: int
) -> Response:
    """`work` on the model's text side, on the tokenizer thread; its JSON written there too."""
    rt: Runtime = request.app.state.runtime
    target = _target(rt, model)

    def run() -> bytes:
        side = rt.served.tokenizers.of(target) if isinstance(target, CatalogEntry) else target
        data = wire(work(side)).encode()
        give_back_if_large(size)
        return data

    data = await asyncio.get_running_loop().run_in_executor(rt.tokenizer_executor, run)
    return Response(data, media_type="application/json")


def _check_ids(side: TextSide, ids: list[int], param: str) -> list[bytes]:
    """Each id's bytes; an id outside the vocabulary is a 400 naming its position."""
    out = []
    for i, token in enumerate(ids):
        try:
            out.append(side.token_bytes(token))
        except (IndexError, OverflowError, ValueError):
            raise InvalidParameter(
                f"{param}[{i}]: {token} is not a token id of this model's vocabulary", param=f"{param}[{i}]"
            ) from None
    return out


def _tokenize(side: TextSide, body: TokenizeRequest) -> Tokens:
    parts = [body.content] if isinstance(body.content, str) else body.content
    ids: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            # BOS (add_special) only in front of the first text, as llama.cpp's tokenize_mixed does
            ids += side.tokenize(
                part, add_special=body.add_special and i == 0, parse_special=body.parse_special
            )
        else:
            _check_ids(side, [part], f"content[{i}]")
            ids.append(part)
    pieces = [side.token_bytes(t) for t in ids] if body.with_pieces else None
    return tokens_reply(ids, pieces)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    size = sum(
        len(p) if isinstance(p, str) else 1
        for p in ([body.content] if isinstance(body.content, str) else body.content)
    )
    return await _answer(request, body.model, lambda side: _tokenize(side, body), size)


def _detokenize(side: TextSide, ids: list[int]) -> Detokenized:
    return detokenized(b"".join(_check_ids(side, ids, "tokens")))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return await _answer(request, body.model, lambda side: _detokenize(side, body.tokens), len(body.tokens))


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> Response:
    messages = body.message_dicts()
    size = sum(len(str(m.get("content") or "")) for m in messages)
    return await _answer(request, body.model, lambda side: applied(side.chat_text(messages)), size)


@router.post("/embedding")
@router.post("/embeddings")
async def embedding(body: LlamaEmbeddingRequest, request: Request) -> Response:
    target = embedding_target(request, body.model, body.route)
    if target.entry is not None:  # an upstream-only model's vectors are normalised as they come
        check_normalize(body.embd_normalize, bool(target.entry.architecture.get("normalize", True)))
    got = await embed(request, target, *body.inputs())
    if got is None:
        return Response(status_code=499)  # the client left; uvicorn needs an answer
    content = await asyncio.to_thread(embedding_body, got, body.embd_normalize)
    return Response(content, media_type="application/json", headers=target.headers())
