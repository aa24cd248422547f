"""OpenAI-compatible endpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.routes.completion_flow import complete
from server.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from server.app import Runtime

router = APIRouter(prefix="/v1")


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await complete(request, "chat", body, body.message_dicts())


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await complete(request, "text", body, body.prompt_text())


@router.get("/models")
async def models(request: Request) -> dict:
    rt: Runtime = request.app.state.runtime
    engine = rt.worker.engine
    entry = {
        "id": rt.model_id(),
        "object": "model",
        "created": rt.started,
        "owned_by": "simmer",
        # simmer extras: what is installed and what runs now
        "variants": list(engine.variants) if engine else [],
        "variant": engine.variant if engine else None,
        "context_length": engine.context_length if engine else None,
    }
    # Ids served only upstream (SIMMER_UPSTREAM_MODELS), when the routing policy lets requests leave.
    remote = [
        {"id": m, "object": "model", "created": rt.started, "owned_by": "upstream", "remote": True}
        for m in (rt.router.remote_models() if rt.router else [])
    ]
    return {"object": "list", "data": [entry, *remote]}
