"""OpenAI's Responses API, stateless: POST /v1/responses. The body is read by requests.py, translated
once by translate.py, answered by render.py; generation goes through server/api/common/flow.py like
/v1/chat/completions (same worker, queue, governor, router)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.common.flow import respond, start
from server.api.responses.render import ResponseObject, ResponsesRenderer
from server.api.responses.requests import ResponsesRequest
from server.api.responses.translate import draft

router = APIRouter(prefix="/v1")


@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    rid = "resp_" + uuid.uuid4().hex[:24]
    gen = await start(request, draft(body), rid=rid)
    return await respond(request, gen, ResponsesRenderer(ResponseObject(rid, gen.model, body)))
