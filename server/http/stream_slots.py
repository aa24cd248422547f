"""Event streams a server holds open at once, in all and per client.

A subscriber to an endless event stream (GET /v1/thermal/events) is a connection at work for as long as it
likes, and the connection guard (connections.py) never closes one at work: 63 subscribers filled a cap of
64 and every new connection, /health included, was closed at once. So such streams are bounded well under
the cap (an eighth of it, at most 64), and one client (its address and its API key) may hold half of them:
the rest of the cap stays for requests.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter

MAX_STREAMS = 64


def stream_limits(connection_cap: int) -> tuple[int, int]:
    """(in all, per client) for a server that keeps at most `connection_cap` connections."""
    total = max(2, min(MAX_STREAMS, connection_cap // 8))
    return total, max(1, total // 2)


def client_key(host: str | None, authorization: str | None) -> str:
    """Who holds a stream: the peer's address and (as a digest) the key it presented."""
    key = hashlib.sha256((authorization or "").encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{host or '?'}|{key}"


class StreamSlots:
    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, client: str) -> str | None:
        """None when `client` may open one more stream (it is counted; give it back with release), else
        why not."""
        with self._lock:
            if sum(self._held.values()) >= self.total:
                return f"the server holds its most event streams ({self.total}) open already"
            if self._held[client] >= self.per_client:
                return f"this client holds its most event streams ({self.per_client}) open already"
            self._held[client] += 1
            return None

    def release(self, client: str) -> None:
        with self._lock:
            self._held[client] -= 1
            if self._held[client] <= 0:
                del self._held[client]
