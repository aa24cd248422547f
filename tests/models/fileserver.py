"""A local HTTP file server in a thread, with the faults a phone network and a CDN produce.

It serves `files[path]` with an ETag and Last-Modified, honours `Range` + `If-Range` like a CDN (unless
told to ignore ranges), can drop the connection after a number of bytes, answer 416 for a range past the
end, redirect like the Hugging Face Hub (`/<repo>/resolve/<rev>/<file>` -> 302 with X-Linked-Etag to the
same server under another host name), and records every request's headers and every byte it sent.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Served:
    data: bytes
    etag: str | None = '"v1"'
    last_modified: str | None = "Mon, 01 Jan 2024 00:00:00 GMT"


@dataclass
class FileServer:
    files: dict[str, Served] = field(default_factory=dict)
    ignore_range: bool = False
    drop_after: list[int] = field(default_factory=list)  # per response with a body, in order: bytes to send
    stall: threading.Event | None = None  # when set on a drop: hang there instead of closing
    errors: dict[str, tuple[int, dict[str, str]]] = field(default_factory=dict)  # path -> status, headers
    linked_etag: dict[str, str] = field(default_factory=dict)  # hub path -> X-Linked-Etag value
    requests: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0  # body bytes written, over all responses

    def __post_init__(self) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stall is not None:
            self.stall.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = self.path
                server.requests.append({"method": self.command, "path": path, **dict(self.headers)})
                if path in server.errors:
                    status, headers = server.errors[path]
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m:  # the Hub: redirect to its "CDN", another host name for the same server
                    self.send_response(302)
                    self.send_header("Location", server.url(f"/cdn/{m.group(3)}", host="localhost"))
                    if path in server.linked_etag:
                        self.send_header("X-Linked-Etag", server.linked_etag[path])
                    self.send_header("ETag", '"git-sha1-of-the-pointer"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                served = server.files.get(path)
                if served is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = served.data
                start = 0
                rng = self.headers.get("Range")
                if_range = self.headers.get("If-Range")
                fresh = if_range is None or if_range in (served.etag, served.last_modified)
                if rng and not server.ignore_range and fresh:
                    start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                if served.etag:
                    self.send_header("ETag", served.etag)
                if served.last_modified:
                    self.send_header("Last-Modified", served.last_modified)
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body:
                    return
                chunk = data[start:]
                if server.drop_after:
                    chunk = chunk[: server.drop_after.pop(0)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    server.sent += len(chunk)
                    if server.stall is not None:
                        server.stall.wait(30)
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
                server.sent += len(chunk)

        return Handler


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
