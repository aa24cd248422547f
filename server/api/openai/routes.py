"""OpenAI-compatible endpoints."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from models.errors import ModelNotFound
from models.types import KIND_EMBEDDING
from models.variant_facts import floor_facts, refused_variants, variant_facts
from server.api.common.embeddings import check_dimensions, embed, embedding_target
from server.api.common.flow import ClientGone, Submission, collect, respond, start, wait_started
from server.api.common.names import LATEST
from server.api.common.reply import reply_response
from server.api.openai.embeddings import EmbeddingRequest, embedding_body
from server.api.openai.render import OpenAIRenderer
from server.api.openai.replies import Model, ModelList
from server.api.openai.requests import ChatCompletionRequest, CompletionRequest
from server.api.openai.translate import chat_draft, completion_draft
from server.serving.catalog import CatalogEntry
from server.serving.request import Draft

if TYPE_CHECKING:
    from server.api.context import Runtime
    from server.serving.model_pool import LoadedView

router = APIRouter(prefix="/v1")


async def complete(request: Request, draft: Draft, n: int = 1) -> Response:
    """/v1/chat/completions and /v1/completions; `n` choices are as many replies, queued at once so that
    they decode together where a batch's rows allow (or take turns), each a choice of one body or stream."""
    rid = ("chatcmpl-" if draft.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    renderer = OpenAIRenderer(draft.kind, draft.show.include_usage)
    if n == 1:
        return await respond(request, await start(request, draft, rid=rid), renderer)
    gens: list[Submission] = []
    try:
        for i in range(n):
            gens.append(await start(request, choice_draft(draft, i), rid=rid))
        if draft.show.stream:
            # the headers wait for the first choice's prompt (a prompt too long is a 413 for all)
            started = await wait_started(request, gens[0])
            if started is False:
                raise ClientGone
            return renderer.streams(gens, started)
        results = []
        for gen in gens:
            got = await collect(request, gen)
            if got is None:  # the client left: the other replies stop too
                raise ClientGone
            results.append(got)
    except BaseException as err:
        for gen in gens:  # out of the queue, or stopped; each request line says client_gone
            gen.abandon()
        if isinstance(err, ClientGone):
            return Response(status_code=499)  # nobody reads it; uvicorn needs an answer
        raise
    return renderer.replies(gens, results)


def choice_draft(draft: Draft, i: int) -> Draft:
    """Choice i of a request: with a seed, seed + i, so that seeded choices differ and each is
    reproducible (without a seed each reply draws its own)."""
    seed = draft.asked.seed
    if i == 0 or seed is None:
        return draft
    seed = seed + i if seed + i < 2**63 else seed - i  # within int64, as every seed
    return replace(draft, asked=replace(draft.asked, seed=seed))


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await complete(request, chat_draft(body), body.n)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await complete(request, completion_draft(body), body.n)


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    target = embedding_target(request, body.model, body.route)
    check_dimensions(target.entry, body.dimensions)
    got = await embed(request, target, body.input, dimensions=body.dimensions)
    if got is None:
        return Response(status_code=499)  # the client left; uvicorn needs an answer
    content = await asyncio.to_thread(embedding_body, target.model, got, body.encoding_format)
    return Response(content, media_type="application/json", headers=target.headers())


@router.get("/models")
async def models(request: Request) -> Response:
    """Every installed model (simmer extras: variants, disk size, context, chat, loaded, memory), then the
    ids served only upstream when the routing policy lets requests leave."""
    return reply_response(ModelList(object="list", data=await listed(request)))


async def listed(request: Request) -> list[Model]:
    rt: Runtime = request.app.state.runtime
    entries = await asyncio.to_thread(rt.served.catalog.entries)  # the store: a few small files
    loaded = rt.served.pool.loaded()
    data = [model_entry(rt, e, loaded.get(e.id)) for e in sorted(entries, key=lambda e: e.id != rt.model)]
    if not data:  # one engine that has not loaded yet
        data = [Model(**_base(rt, rt.model), loaded=False)]
    remote = [
        Model(id=m, object="model", created=rt.started, owned_by="upstream", remote=True)
        for m in (rt.router.remote_models() if rt.router else [])
    ]
    return [*data, *remote]


@router.get("/models/{model:path}")
async def model(model: str, request: Request) -> Response:
    """One model as `/v1/models` lists it (client.models.retrieve). An Ollama-style name with the default
    tag (`smollm2-135m-instruct:latest`) names the model listed without it, as every route reads it; an id
    with a slash (an upstream's `org/name`) is one path. Any other name: 404 model_not_found, as OpenAI's."""
    by_id = {entry.id: entry for entry in await listed(request)}
    found = by_id.get(model) or by_id.get(model.removesuffix(LATEST))
    if found is None:
        raise ModelNotFound(f"The model '{model}' does not exist", param="model")
    return reply_response(found)


def _base(rt: Runtime, model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": rt.started, "owned_by": "simmer"}


def model_entry(rt: Runtime, entry: CatalogEntry, loaded: LoadedView | None) -> Model:
    served = rt.served
    variant = loaded.variant if loaded else entry.default_variant
    model_ctx = entry.context_length
    context = served.context_length(entry)
    resident = loaded.bytes if loaded else (served.cost(entry, variant).total if served.cost else None)
    rungs = [r.variant for r in served.ladder if r.model_id == entry.id]
    return Model(
        **_base(rt, entry.id),
        default=entry.id == rt.model,
        variants=entry.variants,
        variant=variant,
        disk_bytes=entry.disk_bytes,
        context_length=context,
        max_context_length=model_ctx,
        can_chat=entry.can_chat,
        kind="embedding" if entry.kind == KIND_EMBEDDING else "generation",
        loaded=loaded is not None,
        keep_alive_s=None if loaded is None or loaded.expires_in_s is None else round(loaded.expires_in_s, 1),
        resident_bytes_estimate=resident or None,
        ladder_rungs=rungs,
        # measured at pull time on this machine: quality against the fp32 reference, speed
        variant_quality=variant_facts(entry.manifest),
        quality_floor=floor_facts(entry.manifest),
        refused_variants=refused_variants(entry.manifest),
    )
