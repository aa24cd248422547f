"""The browser UI: one page at `/` and its static files (no CDN, no build step).

`/` is also where Ollama's clients and scripts check that the server runs (HEAD or GET, expecting
"Ollama is running"). Both are served by the Accept header: a browser's navigation always asks for
text/html first and gets the page; anything else (Ollama's clients send application/json, curl and
HTTP libraries */*) gets Ollama's plain-text answer. `Vary: Accept` keeps caches from mixing them.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[2] / "static"

router = APIRouter()


OLLAMA_RUNNING = "Ollama is running"


def wants_html(accept: str) -> bool:
    media = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return "text/html" in media or "application/xhtml+xml" in media


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def index(request: Request) -> Response:
    vary = {"Vary": "Accept"}
    if wants_html(request.headers.get("accept", "")):
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=vary)
    return PlainTextResponse(OLLAMA_RUNNING, headers=vary)


def mount_static(app) -> None:  # type: ignore[no-untyped-def]
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
