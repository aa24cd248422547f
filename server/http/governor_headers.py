"""The governor's state on every API response, as headers, so any client (Ollama's, the openai SDK, curl -i)
can see why a reply is slow or held without asking /v1/thermal:

    X-Simmer-Governor-Level: nominal | fair | serious | critical
    X-Simmer-Paused: true | false      (new or running work is held: device hot, app in the background)

The values are read when the response starts (a stream's headers say how it began). Servers without a
governor send neither. The browser UI's page and files carry none.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LEVEL_HEADER = "X-Simmer-Governor-Level"
PAUSED_HEADER = "X-Simmer-Paused"
UI_PREFIX = "/static/"


def governor_headers(snapshot: Callable[[], object] | None) -> Callable[[], list[tuple[bytes, bytes]]]:
    """The headers to add now, from a gate's `snapshot` (None: no governor, no headers)."""
    if snapshot is None:
        return list

    def read() -> list[tuple[bytes, bytes]]:
        snap = snapshot()
        limits = snap.limits  # type: ignore[attr-defined]
        paused = bool(limits.pause_new or limits.pause_running)
        return [
            (LEVEL_HEADER.lower().encode(), str(snap.level).encode()),  # type: ignore[attr-defined]
            (PAUSED_HEADER.lower().encode(), b"true" if paused else b"false"),
        ]

    return read


class GovernorHeadersMiddleware:
    """Pure ASGI (streams pass through untouched): adds the headers to every response but the UI's."""

    def __init__(self, app: ASGIApp, *, snapshot: Callable[[], object] | None) -> None:
        self.app = app
        self.headers = governor_headers(snapshot)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path or path == "/" or path.startswith(UI_PREFIX):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers()]}
            await send(message)

        await self.app(scope, receive, with_headers)
