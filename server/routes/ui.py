"""The browser UI: one page at `/` and its static files (no CDN, no build step)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


def mount_static(app) -> None:  # type: ignore[no-untyped-def]
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
