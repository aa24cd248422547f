"""A TCP proxy that counts the connections it accepts: how the tests see what reaches the upstream.

Modes, switchable while it runs: forward to a target; `drop` (accept, then close at once: a host that is up
but whose server died); `cut_after` N bytes towards the client (the connection dies mid-response).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class CountingProxy:
    def __init__(self, target_port: int | None) -> None:
        self.target_port = target_port  # None: drop every connection
        self.cut_after: int | None = None
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> CountingProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result(5)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.target_port is None:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        budget = [self.cut_after]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, counted: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if counted and budget[0] is not None:
                        data = data[: budget[0]]
                        budget[0] -= len(data)
                    dst.write(data)
                    await dst.drain()
                    if counted and budget[0] is not None and budget[0] <= 0:
                        break
            # Either side ended (or the cut): end both, as a dead peer would.
            for w in (writer, up_writer):
                w.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))
        self._writers -= {writer, up_writer}
