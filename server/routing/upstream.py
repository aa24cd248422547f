"""The HTTP side of an upstream: one pooled httpx.AsyncClient, a bounded SSE parser (sse_reader.py), what is
forwarded, and every way a call can fail, classified for the breaker and mapped into simmer's errors.

What leaves the device (docs/routing.md): the model name the upstream knows, the messages (role and text) or
the prompt, and the generation fields the client set explicitly. Never the client's headers, its key, its
`user`, or simmer's own extension fields. Simmer's key for the upstream (SIMMER_UPSTREAM_API_KEY) goes in
the Authorization header only, and is scrubbed from anything the upstream sends back.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import ssl
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import httpx

from models.errors import ContextLengthExceeded, InvalidParameter, ModelNotFound, SimmerError
from server.refusals import UpstreamError, UpstreamUnavailable
from server.routing.sse_reader import LineTooLong, sse_events
from server.serving.request import GenerationRequest

Endpoint = Literal["chat", "text"]
PATHS: dict[Endpoint, str] = {"chat": "/chat/completions", "text": "/completions"}

# Fields forwarded when the client set them (GenerationRequest.upstream, in OpenAI's names). simmer's own
# extensions (truncate, governor_events, route) stay home; ignore_eos and the llama.cpp/vLLM sampling
# extras go, since every server simmer documents as an upstream knows them.
_SHARED = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repeat_penalty",
    "repetition_penalty",
    "ignore_eos",
)
_CHAT = ("max_tokens", "max_completion_tokens", "logprobs", "top_logprobs")
_TEXT = ("max_tokens", "logprobs")

MAX_MESSAGE_CHARS = 500  # of an upstream error message passed on to the client
# What is read of an upstream's answer, whatever it sends: an error body (its message is cut to
# MAX_MESSAGE_CHARS anyway), and one stream event (a chunk with 20 top logprobs is about 4 KB).
MAX_ERROR_BYTES = 64 << 10
MAX_EVENT_BYTES = 256 << 10
_OFFLINE_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN}


def base_url(url: str) -> str:
    """The OpenAI base URL: as given (it names its /v1 or /openai/v1 path), or `/v1` for a bare host."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def forward_body(request: GenerationRequest, model: str) -> dict:
    """The request the upstream gets. Always streamed with usage: one code path whatever the client asked,
    the first token is known (no side switch after it), and a disconnect can cancel it."""
    out: dict[str, Any] = {"model": model}
    if request.kind == "chat":
        out["messages"] = [{"role": m["role"], "content": m["content"]} for m in request.messages or ()]
    else:
        out["prompt"] = list(request.prompt) if isinstance(request.prompt, tuple) else request.prompt
    explicit = dict(request.upstream)
    for name in _SHARED + (_CHAT if request.kind == "chat" else _TEXT):
        if explicit.get(name) is not None:
            out[name] = explicit[name]
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    return out


# -- failures ---------------------------------------------------------------------------------------------
FailureKind = Literal[
    "offline",  # no route to the host, no DNS: the device is off the network
    "connect",  # refused, reset while connecting
    "tls",  # the certificate did not verify (or another TLS failure)
    "timeout",  # connect, read, write or pool timeout
    "dropped",  # the connection ended mid-response
    "server_error",  # HTTP 5xx
    "rate_limited",  # HTTP 429
    "auth",  # HTTP 401/403: simmer's key is wrong
    "redirect",  # HTTP 3xx: not followed (it could carry the key elsewhere); the URL needs fixing
    "client_error",  # other HTTP 4xx: the request, not the upstream (does not count against it)
    "bad_response",  # not SSE, not JSON
    "error_event",  # an error chunk inside the stream
]


@dataclass
class UpstreamFailure(Exception):
    kind: FailureKind
    message: str
    status: int | None = None
    retry_after_s: float | None = None
    code: str | None = None  # the upstream's own error code, if it sent one

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    @property
    def counts(self) -> bool:
        """Does it count against the upstream (breaker)? A bad request is not the upstream's failure."""
        return self.kind != "client_error"

    def describe(self) -> str:
        """For people: `upstream HTTP 503: busy` or `upstream connect: Connection refused`."""
        where = f"HTTP {self.status}" if self.status is not None else self.kind
        return f"upstream {where}: {self.message}"


def classify(err: httpx.HTTPError) -> UpstreamFailure:
    if isinstance(err, httpx.TimeoutException):
        return UpstreamFailure("timeout", f"{type(err).__name__}")
    if isinstance(err, httpx.ConnectError):
        cause = _root_os_error(err)
        if isinstance(cause, ssl.SSLCertVerificationError):
            return UpstreamFailure("tls", f"certificate verify failed: {cause.verify_message}")
        if isinstance(cause, ssl.SSLError):
            return UpstreamFailure("tls", cause.reason or str(cause))
        if isinstance(cause, socket.gaierror) or (cause is not None and cause.errno in _OFFLINE_ERRNOS):
            return UpstreamFailure("offline", _os_text(cause))
        return UpstreamFailure("connect", _os_text(cause) if cause else str(err) or "connect failed")
    if isinstance(err, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError | httpx.CloseError):
        return UpstreamFailure("dropped", str(err) or type(err).__name__)
    return UpstreamFailure("dropped", f"{type(err).__name__}: {err}")


def _root_os_error(err: BaseException) -> OSError | None:
    """The OS error under httpx's ConnectError (through anyio's "All connection attempts failed")."""
    seen: BaseException | None = err
    for _ in range(10):
        if seen is None:
            return None
        if isinstance(seen, socket.gaierror) or (isinstance(seen, OSError) and seen.errno is not None):
            return seen
        group = getattr(seen, "exceptions", None)
        if group:
            seen = group[0]
            continue
        seen = seen.__cause__ or seen.__context__
    return None


def _os_text(err: OSError | None) -> str:
    if err is None:
        return "connect failed"
    if isinstance(err, socket.gaierror):
        return f"cannot resolve the host ({err.strerror or err})"
    return os.strerror(err.errno) if err.errno else str(err) or type(err).__name__


def retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        from datetime import UTC, datetime

        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError, OverflowError):
        return None


def failure_from_response(status: int, body: bytes, headers: httpx.Headers) -> UpstreamFailure:
    message, code = _error_text(body)
    after = retry_after(headers.get("retry-after"))
    if status == 429:
        kind: FailureKind = "rate_limited"
    elif status in (401, 403):
        kind = "auth"
    elif status == 408 or status >= 500:
        kind = "server_error"
    elif 300 <= status < 400:
        kind = "redirect"
        where = headers.get("location")
        message = f"redirected{f' to {where}' if where else ''}; simmer does not follow redirects"
    else:
        kind = "client_error"
    return UpstreamFailure(kind, message or f"HTTP {status}", status=status, retry_after_s=after, code=code)


async def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    """The first `limit` bytes of a body, without reading the rest (the response is closed after)."""
    got = bytearray()
    async for piece in response.aiter_bytes():
        got += piece[: limit - len(got)]
        if len(got) >= limit:
            break
    return bytes(got)


def failure_from_chunk(chunk: dict) -> UpstreamFailure:
    message, code = _error_text(json.dumps(chunk).encode())
    return UpstreamFailure("error_event", message or "error event", code=code)


def _error_text(body: bytes) -> tuple[str, str | None]:
    """The message and code of an OpenAI-shaped error body (or FastAPI's {"detail"}, or plain text)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:MAX_MESSAGE_CHARS], None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        return str(err.get("message") or "")[:MAX_MESSAGE_CHARS], str(code) if code is not None else None
    if isinstance(err, str):
        return err[:MAX_MESSAGE_CHARS], None
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:MAX_MESSAGE_CHARS], None
    return str(data)[:MAX_MESSAGE_CHARS], None


def to_simmer_error(failure: UpstreamFailure, *, mid_reply: bool, retry_in_s: float | None) -> SimmerError:
    """The failure in simmer's vocabulary, the upstream's status in the message."""
    what = failure.describe()
    if mid_reply:
        return UpstreamError(f"The upstream failed mid-reply ({what}); the reply is incomplete.")
    if failure.kind == "client_error":
        status = failure.status or 400
        if status == 404:
            return ModelNotFound(f"The upstream does not know this model ({what})", param="model")
        if status == 413 or failure.code == "context_length_exceeded":
            return ContextLengthExceeded(f"The upstream refused the prompt as too long ({what})")
        return InvalidParameter(f"The upstream refused the request ({what})")
    if failure.kind == "auth":
        return UpstreamError(
            f"The upstream refused simmer's credentials ({what}); check SIMMER_UPSTREAM_API_KEY."
        )
    if failure.kind == "redirect":
        return UpstreamError(f"The upstream answered with a redirect ({what}); fix SIMMER_UPSTREAM_URL.")
    wait = retry_in_s if retry_in_s else failure.retry_after_s
    return UpstreamUnavailable(f"The upstream is unavailable ({what}).", retry_after_s=wait)


# -- the client -----------------------------------------------------------------------------------------
class UpstreamClient:
    """One pooled AsyncClient for the server's lifetime. TLS is verified (certifi, SSL_CERT_FILE, or
    `ca_bundle`); redirects are not followed (a redirect could carry the key elsewhere)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        ca_bundle: Path | None = None,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 120.0,
        max_connections: int = 16,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = base_url(url)
        self._key = api_key or None
        headers = {"User-Agent": "simmer"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        verify: ssl.SSLContext | bool = True
        if ca_bundle is not None:
            verify = ssl.create_default_context(cafile=str(ca_bundle))
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            # A request waits for a pooled connection as long as a stalled reply may hold one (the relay ends
            # a reply that sends no token for the read timeout): a pool full of slow replies delays the
            # next request, it does not fail it.
            timeout=httpx.Timeout(
                read_timeout_s, connect=connect_timeout_s, write=30.0, pool=read_timeout_s + connect_timeout_s
            ),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            verify=verify,
            follow_redirects=False,
            transport=transport,
        )

    @property
    def display_url(self) -> str:
        """The URL without query or credentials (settings refuse credentials in it anyway)."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    def scrub(self, text: str) -> str:
        """Never echo the key, even if the upstream quotes it back."""
        return text.replace(self._key, "[redacted]") if self._key else text

    async def chunks(
        self, endpoint: Endpoint, body: dict, on_response: Callable[[], None] = lambda: None
    ) -> AsyncGenerator[dict, None]:
        """The upstream's stream chunks (parsed JSON) until `data: [DONE]`. Raises UpstreamFailure.
        Closing or cancelling the iteration closes the response: the upstream sees its client leave.
        Bounded: an error body is read up to MAX_ERROR_BYTES, an event up to MAX_EVENT_BYTES.
        `on_response` is called when the response's headers are in (the wait for a pooled connection,
        the connect and the upstream's first answer are behind)."""
        try:
            async with self._client.stream("POST", PATHS[endpoint].lstrip("/"), json=body) as response:
                on_response()
                if response.status_code != 200:
                    failure = failure_from_response(
                        response.status_code, await _read_at_most(response, MAX_ERROR_BYTES), response.headers
                    )
                    failure.message = self.scrub(failure.message)
                    raise failure
                kind = response.headers.get("content-type", "")
                if kind.partition(";")[0].strip().lower() != "text/event-stream":
                    got = self.scrub(kind)[:100]
                    raise UpstreamFailure(
                        "bad_response",
                        f"Expected response header Content-Type to contain 'text/event-stream', got {got!r}",
                    )
                async for event, data in sse_events(response.aiter_bytes(), MAX_EVENT_BYTES):
                    if event not in ("message", ""):
                        continue  # a server's own event types (simmer's `governor`): not ours to relay
                    if data.strip() == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise UpstreamFailure("bad_response", "a stream event is not JSON") from None
                    if not isinstance(chunk, dict):
                        raise UpstreamFailure("bad_response", "a stream event is not a JSON object")
                    if "error" in chunk:
                        failure = failure_from_chunk(chunk)
                        failure.message = self.scrub(failure.message)
                        raise failure
                    yield chunk
            raise UpstreamFailure("dropped", "the stream ended without [DONE]")
        except httpx.HTTPError as err:
            raise classify(err) from err
        except LineTooLong as err:
            raise UpstreamFailure("bad_response", str(err)) from err

    async def answer(self, path: str, body: dict, max_bytes: int) -> bytes:
        """One answer that is not streamed (POST `path`, e.g. /embeddings): its body, read to at most
        `max_bytes`; a longer one is a bad_response and the rest is never read. Raises UpstreamFailure.
        httpx's timeouts apply to each read; the caller bounds the whole exchange."""
        try:
            async with self._client.stream("POST", path.lstrip("/"), json=body) as response:
                if response.status_code != 200:
                    failure = failure_from_response(
                        response.status_code, await _read_at_most(response, MAX_ERROR_BYTES), response.headers
                    )
                    failure.message = self.scrub(failure.message)
                    raise failure
                got = await _read_at_most(response, max_bytes + 1)
        except httpx.HTTPError as err:
            raise classify(err) from err
        if len(got) > max_bytes:
            raise UpstreamFailure("bad_response", f"the answer is over {max_bytes} bytes")
        return got

    async def aclose(self) -> None:
        await self._client.aclose()
