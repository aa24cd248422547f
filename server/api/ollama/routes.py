"""Ollama's API (https://github.com/ollama/ollama/blob/main/docs/api.md) on the same worker, queue,
governor and router as the OpenAI routes: generation goes through completion_flow with an NDJSON
renderer; model management uses the store.

Errors are Ollama's `{"error": "..."}` (server/http/errors.py shapes every error under /api/), with simmer's
statuses (404 for an unknown model, 400 for a bad request, 503 busy, 500 a bug); an error after a stream
started comes as one more line, `{"error": "..."}`, and the stream ends.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from models.errors import ModelNotFound, SimmerError
from models.store import registry
from models.store.registry import license_notice
from models.types import KIND_EMBEDDING
from server.api.common.embeddings import EmbedTarget, embedding_target, parse_inputs
from server.api.common.embeddings import embed as common_embed
from server.api.common.flow import respond, start
from server.api.common.names import model_id
from server.api.common.reply import reply_response
from server.api.ollama import requests as wire
from server.api.ollama.embeddings import embed_body, embedding_body, inputs_of
from server.api.ollama.render import NDJSON, Kind, NdjsonRenderer, PullProgress, control, iso, ollama_name
from server.api.ollama.replies import (
    OllamaDetails,
    OllamaModel,
    OllamaModels,
    OllamaProgress,
    OllamaShow,
    OllamaVersion,
)
from server.api.ollama.translate import chat_draft, generate_draft
from server.http.errors import ApiError
from server.refusals import ModelLoading, ServerBusy
from server.serving.catalog import CatalogEntry, installed
from server.serving.deferred import MAX_WAITING, wait_for_background
from server.serving.embedding import Embedded
from server.serving.request import Draft

if TYPE_CHECKING:
    from server.api.context import Runtime

log = logging.getLogger("simmer.ollama")

router = APIRouter(prefix="/api")

# The Ollama API level whose wire format these routes follow (clients gate features on /api/version).
OLLAMA_API_VERSION = "0.12.0"


def _not_found(rt: Runtime, name: str) -> SimmerError:
    """Ollama's words for an unknown model; an installed model this server does not serve says so."""
    model = model_id(name)
    if any(m.id == model for m in installed(rt.model_store)):
        return ModelNotFound(
            f"model '{name}' is installed but not served: this server serves '{rt.model}' "
            f"(start it with SIMMER_MODEL={model})",
            param="model",
        )
    return ModelNotFound(f"model '{name}' not found", param="model")


async def _generate(request: Request, kind: Kind, body: wire.OllamaTurn, draft: Draft) -> Response:
    rt: Runtime = request.app.state.runtime
    rid = f"ollama-{uuid.uuid4().hex[:24]}"
    try:
        gen = await start(request, draft, rid=rid)
    except ModelNotFound:
        raise _not_found(rt, body.model) from None
    return await respond(request, gen, NdjsonRenderer(kind, body.model))


def _control(request: Request, kind: Kind, body: wire.OllamaTurn) -> Response:
    """No prompt (no messages): Ollama's load request, or with keep_alive 0 its unload request."""
    rt: Runtime = request.app.state.runtime
    if body.model_id not in rt.served.ids():
        raise _not_found(rt, body.model)
    if body.keep_alive_s() == 0:  # unload: the worker does it once no job uses the model
        rt.worker.unload_when_idle(body.model_id)
        return reply_response(control(kind, body.model, "unload"))
    if rt.worker.state != "ready":
        raise ModelLoading("The server is not taking requests now; retry shortly")
    rt.worker.warm(body.model_id)  # built beside the worker; a request for it meanwhile waits for it
    return reply_response(control(kind, body.model, "load"))


@router.post("/chat")
async def chat(body: wire.OllamaChatRequest, request: Request) -> Response:
    if not body.messages:
        return _control(request, "chat", body)
    return await _generate(request, "chat", body, chat_draft(body))


@router.post("/generate")
async def generate(body: wire.OllamaGenerateRequest, request: Request) -> Response:
    if not body.prompt:
        return _control(request, "generate", body)
    rt: Runtime = request.app.state.runtime
    entry = rt.served.resolve(body.model_id)  # None: not served here (upstream, or a 404 from the router)
    # raw: the prompt as written; a base model (no chat template) continues the text, as ollama run does
    as_chat = not body.raw and (entry is None or entry.can_chat)
    return await _generate(request, "generate", body, generate_draft(body, as_chat=as_chat))


# ---- models -------------------------------------------------------------------------------------------


def _details(entry: CatalogEntry, variant: str | None = None) -> OllamaDetails:
    family = entry.family
    return OllamaDetails(
        parent_model="",
        format="onnx",  # simmer serves ONNX converted from the GGUF
        family=family,
        families=[family] if family else None,
        parameter_size="",
        quantization_level=variant or entry.default_variant or "",
    )


def _capabilities(entry: CatalogEntry) -> list[str]:
    """As Ollama's /api/show says them; tools only where the model chats (models/runtime/tools.py)."""
    if entry.kind == KIND_EMBEDDING:
        return ["embedding"]
    return ["completion", "tools"] if entry.can_chat else ["completion"]


def _tag(entry: CatalogEntry, variant: str | None = None) -> OllamaModel:
    name = ollama_name(entry.id)
    return OllamaModel(
        name=name,
        model=name,
        modified_at=iso(entry.created),
        size=entry.size_bytes,
        digest=entry.digest,
        details=_details(entry, variant),
        capabilities=_capabilities(entry),
    )


@router.head("/tags", include_in_schema=False)
@router.get("/tags")
async def tags(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    local = await asyncio.to_thread(_listing, rt)  # reads the store: off the event loop
    loaded = rt.served.pool.loaded()
    models = [_tag(m, loaded[m.id].variant if m.id in loaded else None) for m in local]
    # Ids served only upstream, when the routing policy lets requests leave (as /v1/models lists them).
    for remote in rt.router.remote_models() if rt.router else []:
        name = ollama_name(remote)
        models.append(
            OllamaModel(
                name=name,
                model=name,
                modified_at=iso(""),
                size=0,
                digest="",
                remote_host="upstream",
                details=OllamaDetails(format="upstream"),
            )
        )
    return reply_response(OllamaModels(models=models))


def _listing(rt: Runtime) -> list[CatalogEntry]:
    """The served models (the default first), then the installed ones this server does not serve."""
    served = rt.served.entries()
    ids = {e.id for e in served}
    return [*served, *(m for m in installed(rt.model_store) if m.id not in ids)]


def _find(rt: Runtime, model: str) -> CatalogEntry | None:
    """A served model, or an installed one, by exact id."""
    entry = rt.served.resolve(model) if model else None
    return entry or next((m for m in installed(rt.model_store) if m.id == model), None)


def _model_info(rt: Runtime, entry: CatalogEntry) -> dict[str, Any]:
    arch = entry.architecture
    family = entry.family or "unknown"
    context = rt.served.context_length(entry) if entry.id in rt.served.ids() else None
    keys = {
        "context_length": context or arch.get("context_length") or entry.manifest.get("context_length"),
        "embedding_length": arch.get("hidden"),
        "feed_forward_length": arch.get("ffn"),
        "block_count": arch.get("n_layers"),
        "attention.head_count": arch.get("n_heads"),
        "attention.head_count_kv": arch.get("n_kv_heads"),
        "attention.key_length": arch.get("head_dim"),
        "rope.freq_base": arch.get("rope_base"),
        "vocab_size": arch.get("vocab"),
    }
    info: dict[str, Any] = {"general.architecture": family}
    info.update({f"{family}.{k}": v for k, v in keys.items() if v is not None})
    return info


@router.post("/show")
async def show(body: wire.ShowRequest, request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    entry = await asyncio.to_thread(_find, rt, body.model_id)
    if entry is None:
        raise _not_found(rt, body.given)
    d = rt.sampling_defaults
    loaded = rt.served.pool.loaded().get(entry.id)
    template = await asyncio.to_thread(entry.chat_template)
    shown = OllamaShow(
        modelfile=f"# simmer: the chat template is Jinja (see `template`)\nFROM {entry.id}\n",
        parameters=f"temperature {d.temperature:g}\ntop_k {d.top_k}\ntop_p {d.top_p:g}\nmin_p {d.min_p:g}",
        template=template,
        details=_details(entry, loaded.variant if loaded is not None else None),
        model_info=_model_info(rt, entry),
        capabilities=_capabilities(entry),
        modified_at=iso(entry.created),
    )
    return reply_response(shown)


@router.get("/ps")
async def ps(request: Request) -> Response:
    """The models in memory (the worker's pool, and its open embedding model), each with when its keep_alive
    runs out."""
    rt: Runtime = request.app.state.runtime
    if rt.worker.state != "ready":
        return reply_response(OllamaModels(models=[]))
    models = []
    for loaded_id, view in rt.served.pool.loaded().items():
        engine = rt.served.pool.engine(loaded_id)
        entry = _find(rt, loaded_id) or CatalogEntry(
            loaded_id, None, {}, can_chat=False, tokenizer_key=loaded_id
        )
        size = entry.variant_bytes(view.variant) or entry.size_bytes or view.bytes
        context = engine.context_length if engine is not None else None
        models.append(_running(entry, view.variant, size, view.expires_in_s, context))
    encoder = rt.worker.encoder()  # the embedding model the worker has open, beside the pool
    if encoder is not None and (entry := _find(rt, encoder.model_id)) is not None:
        models.append(_running(entry, None, encoder.bytes, encoder.expires_in_s, entry.context_length))
    return reply_response(OllamaModels(models=models))


def _running(
    entry: CatalogEntry, variant: str | None, size: int, expires_in_s: float | None, context: int | None
) -> OllamaModel:
    # "kept until the server stops" as Ollama shows it: centuries ahead
    left = 292 * 365 * 86400.0 if expires_in_s is None else expires_in_s
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=max(0.0, left))
    name = ollama_name(entry.id)
    return OllamaModel(
        name=name,
        model=name,
        size=size,
        digest=entry.digest,
        details=_details(entry, variant),
        size_vram=0,  # CPU only
        expires_at=expires.isoformat().replace("+00:00", "Z"),
        context_length=context,
    )


@router.head("/version", include_in_schema=False)
@router.get("/version")
async def version() -> Response:
    from importlib.metadata import version as package_version

    return reply_response(OllamaVersion(version=OLLAMA_API_VERSION, simmer=package_version("simmer")))


@router.delete("/delete")
async def delete(body: wire.ModelRequest, request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    model = body.model_id
    in_use = _in_use(rt, model)
    if in_use:
        raise ApiError(400, "invalid_parameter", f"model '{body.given}' {in_use}", param="model")
    present = await asyncio.to_thread(installed, rt.model_store)
    if rt.model_store is None or not any(m.id == model for m in present):
        raise ModelNotFound(f"model '{body.given}' not found", param="model")
    store = rt.model_store
    with rt.served.pool.deleting(model) as busy:  # no load of it starts meanwhile
        if busy == "loaded":
            raise ApiError(400, "invalid_parameter", f"model '{body.given}' {_LOADED}", param="model")
        if busy is not None:
            raise ApiError(409, "model_busy", f"model '{body.given}' is {busy} now: delete it once that ends")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(rt.store_executor, store.remove, model)  # may wait for a pull
    await asyncio.to_thread(rt.served.catalog.refresh)  # gone from what the server lists, at once
    return Response(status_code=200)


def _in_use(rt: Runtime, model: str) -> str | None:
    """Why `model` cannot be deleted now (None: it can): the server's own model, a rung of its ladder, or
    loaded (any other installed model can go)."""
    if model == rt.model:
        return "is the model this server serves (SIMMER_MODEL): serve another one before deleting it"
    if model in rt.served.ladder_models():
        return "is on the governor's ladder (SIMMER_LADDER): take it off before deleting it"
    if model in rt.served.pool.loaded():
        return _LOADED
    return None


_LOADED = (
    "is loaded: delete it once it unloads (after its keep_alive, or at once after a request with "
    '"keep_alive": 0)'
)


@router.post("/pull")
async def pull(body: wire.PullRequest, request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    store = rt.model_store
    if store is None:
        raise ApiError(400, "invalid_parameter", "this server has no model store", param="model")
    name = body.model_id
    # An unknown name: 404 at once. A local path only from SIMMER_PULL_DIRS, decided before it is read.
    spec = await asyncio.to_thread(registry.resolve, name, hub=store.hub, local_dirs=rt.pull_dirs)
    progress = PullProgress(asyncio.get_running_loop())

    def install() -> Any:
        # The terms the model comes under first, as `simmer pull` prints them (one status line).
        with store.disk_full_as_error(f"simmer pull {name}", f"reading the license notice of {spec.id}"):
            notice = license_notice(spec.source, store.downloads_dir)
        if notice:
            progress.note(notice)
        return store.pull(name, progress, local_dirs=rt.pull_dirs)

    governor = rt.governor.governor if rt.governor is not None else None
    verdict = governor.snapshot().background if governor is not None else None
    if verdict is not None and not verdict.runs:
        # an app that pulls its model at every start, on battery, gets its answer at once when it is there
        if any(m.id == spec.id for m in await asyncio.to_thread(installed, store)):
            governor = None
        elif rt.deferred.full():
            raise ServerBusy(
                f"{MAX_WAITING} pulls already wait for the device ({verdict.why}); retry once it allows"
            )

    async def when_the_device_allows() -> Any:
        # converting and measuring take every core for minutes: on the charger, cool, in the foreground
        await wait_for_background(governor, rt.deferred, f"pull {spec.id}", progress.note)
        # its own threads: a pull may wait for the model's lock (another pull, `simmer pull --force`)
        return await asyncio.get_running_loop().run_in_executor(rt.store_executor, install)

    task = asyncio.ensure_future(when_the_device_allows())
    task.add_done_callback(lambda t: _pulled(spec.id, t))
    if not body.stream:
        await asyncio.shield(task)  # a client that leaves does not stop the install (as Ollama resumes)
        return reply_response(OllamaProgress(status="success"))
    return StreamingResponse(progress.lines(task), media_type=NDJSON)


def _pulled(model: str, task: asyncio.Future) -> None:
    """The install's outcome, in the log, also when its client left before it ended."""
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        log.info("pulled %s", model)
    else:
        log.warning("pull of %s failed: %s", model, error)


@router.post("/embed")
async def embed(body: wire.EmbedRequest, request: Request) -> Response:
    arrived = time.monotonic_ns()
    target = _embedding_target(request, body)
    texts = inputs_of(body.input)
    got = (
        await _vectors(request, target, texts, fit=body.truncate, keep_alive_s=body.keep_alive_s())
        if texts
        else None
    )
    if texts and got is None:
        return Response(status_code=499)  # the client left; uvicorn needs an answer
    content = await asyncio.to_thread(embed_body, body.model, got, time.monotonic_ns() - arrived)
    return Response(content, media_type="application/json", headers=target.headers())


@router.post("/embeddings")
async def embeddings(body: wire.EmbedRequest, request: Request) -> Response:
    target = _embedding_target(request, body)
    text = body.prompt or ""
    got = await _vectors(request, target, [text], keep_alive_s=body.keep_alive_s()) if text else None
    if text and got is None:
        return Response(status_code=499)
    content = await asyncio.to_thread(embedding_body, got)
    return Response(content, media_type="application/json", headers=target.headers())


def _embedding_target(request: Request, body: wire.EmbedRequest) -> EmbedTarget:
    """The route of an embeddings request; an unknown model in Ollama's words."""
    rt: Runtime = request.app.state.runtime
    try:
        return embedding_target(request, model_id(body.model), body.route)
    except ModelNotFound:
        raise _not_found(rt, body.model) from None


async def _vectors(
    request: Request,
    target: EmbedTarget,
    texts: list[str],
    fit: bool = False,
    keep_alive_s: float | None = None,
) -> Embedded | None:
    return await common_embed(request, target, parse_inputs(texts), fit=fit, keep_alive_s=keep_alive_s)
