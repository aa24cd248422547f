"""Governor endpoints: GET /v1/thermal, GET /v1/thermal/events (SSE), POST /v1/lifecycle."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1")
