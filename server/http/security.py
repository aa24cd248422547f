"""Safe by default: loopback Host names only (DNS rebinding), optional Bearer key, body size limit, a body
without Content-Type read as JSON only when no browser sent it, and a refusal to bind a non-loopback address
without a key."""

from __future__ import annotations

import hmac
import ipaddress
import re

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from models.errors import InvalidParameter
from server.http.errors import ApiError, error_payload, send_error

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
# Answered without an API key: liveness probes, and the browser UI's page and files (they hold no data;
# the page asks for the key and sends it on every API call). The Host check still applies to them.
OPEN_PATHS = {"/health", "/"}
OPEN_PREFIXES = ("/static/",)


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# RFC 9110's Host: a name or IPv4 address, or an IPv6 address in brackets, then an optional port of digits.
# Anything else (`127.0.0.1:80@evil.example`, `[::1`) names no host this server can vouch for.
_HOST = re.compile(r"(?:\[([0-9a-f:.]+(?:%[0-9a-z._~-]+)?)\]|([0-9a-z._-]+))(?::[0-9]{0,5})?")


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'; '' for a header that is no host."""
    match = _HOST.fullmatch(header.strip().lower())
    if match is None:
        return ""
    return match.group(1) or match.group(2)


# Headers only a browser adds on its own: every current browser sends Origin with a POST and the Fetch
# Metadata headers (Sec-Fetch-Site, -Mode, -Dest, -User) with every request; a page's script cannot remove
# them. HTTP clients (litellm's Ollama providers, scripts) send neither.
_BROWSER_PREFIX = "sec-fetch-"


def from_browser(headers: dict[str, str]) -> bool:
    return "origin" in headers or any(name.startswith(_BROWSER_PREFIX) for name in headers)


def assume_json(scope: Scope, headers: dict[str, str]) -> None:
    """A body sent with no Content-Type at all, by a client that is not a browser, is read as JSON (Ollama
    does; litellm's `ollama/` and `ollama_chat/` providers post that way). A browser's body without the JSON
    type stays a 415 (server/http/errors.py): a page can send a "simple" cross-origin POST without a CORS
    preflight, and refusing it is what keeps pages from driving the server."""
    if (
        "content-type" in headers
        or from_browser(headers)
        or scope.get("method") not in ("POST", "PUT", "DELETE")
    ):
        return
    scope["headers"] = [*scope["headers"], (b"content-type", b"application/json")]


def host_refused(header: str) -> str:
    """What a client that reached the server by a name it does not know (a LAN address) must set."""
    name = host_name(header)[:100] or ("(none)" if not header.strip() else "(malformed)")
    return (
        f"Host header {name!r} not allowed: this server answers loopback names and those in "
        f"SIMMER_ALLOWED_HOSTS (a JSON list, e.g. SIMMER_ALLOWED_HOSTS='[\"{name}\"]'), which guards against "
        "DNS rebinding"
    )


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to expose the server beyond this machine without an API key."""
    if not is_loopback(host) and not api_key:
        raise InvalidParameter(
            f"Refusing to bind {host}: a non-loopback address needs an API key "
            "(set SIMMER_API_KEY, or bind 127.0.0.1)",
            param="api_key",
        )


class SecurityMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would break streaming disconnect detection)."""

    def __init__(
        self, app: ASGIApp, *, allowed_hosts: list[str], api_key: str | None, max_body_bytes: int
    ) -> None:
        self.app = app
        self.allowed_hosts = {h.lower() for h in allowed_hosts}
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def _host_ok(self, header: str) -> bool:
        name = host_name(header)
        if not name:
            return False
        return is_loopback(name) or name in self.allowed_hosts or header.strip().lower() in self.allowed_hosts

    def _key_ok(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return (
            scheme.lower() == "bearer"
            and self.api_key is not None
            and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope.get("path", "")
        if not self._host_ok(headers.get("host", "")):
            await send_error(
                send, ApiError(403, "host_not_allowed", host_refused(headers.get("host", ""))), path
            )
            return
        needs_key = self.api_key and not is_open_path(path) and scope.get("method") != "OPTIONS"
        if needs_key and not self._key_ok(headers.get("authorization", "")):
            await send_error(send, ApiError(401, "invalid_api_key", "Missing or invalid API key"), path)
            return
        assume_json(scope, headers)
        limit_msg = f"Request body over {self.max_body_bytes} bytes"
        too_large = ApiError(413, "request_too_large", limit_msg)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_error(send, too_large, path)
            return

        # Chunked bodies carry no length: count as they arrive.
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # An HTTPException, because FastAPI turns other errors while reading the body into 400.
                    raise HTTPException(413, limit_msg)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except HTTPException as exc:
            if started or exc.status_code != 413:
                raise
            else:
                await send_error(send, too_large, path)


class NoCorsMiddleware:
    """CORS off (no origin configured): a preflight is refused as a refused one is with CORS on, 403
    `cors_not_allowed` (not a 405 from the router); anything else passes untouched (no CORS header, no
    `Vary: Origin`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "OPTIONS":
            headers = Headers(scope=scope)
            if "origin" in headers and "access-control-request-method" in headers:
                error = ApiError(403, "cors_not_allowed", "Cross-origin requests are off for this server")
                await send_error(send, error, scope.get("path", ""))
                return
        await self.app(scope, receive, send)


class CorsMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight (foreign origin, method or header) answered in the OpenAI
    error shape, 403 `cors_not_allowed`, instead of a plain-text 400. No Allow-Origin header either way."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        reason = bytes(response.body).decode()  # "Disallowed CORS origin, method"
        status, body, _ = error_payload(ApiError(403, "cors_not_allowed", f"{reason} for this server"))
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        return JSONResponse(body, status_code=status, headers=headers)
