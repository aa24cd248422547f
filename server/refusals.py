"""What the server refuses before or instead of a reply, and why, in the domain's words: busy, loading,
shutting down, paused by the governor, the upstream unavailable or not allowed. server/http/errors.py maps
each `code` to its HTTP status and body; the serving and routing modules raise these without knowing HTTP.
"""

from __future__ import annotations

from models.errors import SimmerError


class ServerBusy(SimmerError):
    """The worker queue is full."""

    code = "server_busy"


class ModelLoading(SimmerError):
    """The engine is still loading (or failed to load)."""

    code = "model_loading"


class ShuttingDown(SimmerError):
    code = "server_shutting_down"


class DevicePaused(SimmerError):
    """The governor paused work (device too hot, app in the background) longer than pause_timeout_s."""

    code = "device_paused"


class UpstreamUnavailable(SimmerError):
    """The upstream cannot take the request (down, offline, busy, breaker open) and local is not allowed."""

    code = "upstream_unavailable"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(SimmerError):
    """The upstream failed in a way a retry will not fix by itself (credentials), mid-reply, or with an
    answer that is not usable (embeddings of the wrong count or width, NaN)."""

    code = "upstream_error"


class UpstreamNotAllowed(SimmerError):
    """The request asked for upstream; the server's policy (SIMMER_ROUTE=local) keeps everything local."""

    code = "upstream_not_allowed"
