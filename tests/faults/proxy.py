"""A TCP proxy on 127.0.0.1 put between two components, to partition them on demand.

`partition()` stops forwarding in both directions: bytes already read wait, the kernel buffers
fill and the peers see silence, as behind a dropped link (TCP would retransmit); new
connections are accepted but not forwarded. `heal()` forwards again, held bytes first.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, port: int, target: tuple[str, int]):
        self.port = port
        self.target = target
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )

    def partition(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream_writer = None
        try:
            await self._open.wait()
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
            await asyncio.gather(
                self._pipe(reader, upstream_writer, writer),
                self._pipe(upstream_reader, writer, upstream_writer),
            )
        except OSError:
            pass  # the target is not listening: the client's connection just closes
        finally:
            self._tasks.discard(task)
            for w in (writer, upstream_writer):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        back: asyncio.StreamWriter,
    ) -> None:
        try:
            while data := await reader.read(65536):
                await self._open.wait()
                writer.write(data)
                await writer.drain()
            # Half-close: the other direction may still carry an answer.
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            # A side reset: end both directions, as a broken link would.
            writer.close()
            back.close()
