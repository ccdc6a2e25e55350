"""The frontend's HTTP server side: uvicorn (httptools parser, uvloop) running a plain ASGI app.

No web framework: the frontend answers six paths, and a framework's request/response objects,
router and middleware were most of the hop's server-side CPU (aiohttp's server cost ~100 µs more
per request than this, measured with `dynamograph bench frontend`). This module owns the
plumbing: uvicorn started and stopped inside the running event loop on a socket we bind (port 0
works), one request's headers, its body read under a cap, whole and streamed responses, and a
client disconnect turned into cancellation of the request's task — ASGI reports a disconnect
only to a pending `receive()`, so one small waiter per generation request watches for it.
"""

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import uvicorn
from multidict import CIMultiDict

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

KEEP_ALIVE_S = 75  # idle client connections (Envoy's pool) stay open this long, as aiohttp did
GRACEFUL_S = 60.0  # on stop, requests in flight get this long to finish
WATCH_AFTER_S = 0.05  # a request watches for its client's disconnect after running this long


class BodyTooLarge(Exception):
    """The request body is over the cap; `length` when the client declared it."""

    def __init__(self, length: int | None):
        super().__init__("request body too large")
        self.length = length


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Exchange:
    """One HTTP request and its response over ASGI.

    `headers`: the request's headers (`get` is case-insensitive; the first of repeated names).
    Responses are either whole (`respond`) or streamed (`start`, `write`..., `end`); `started`
    says whether the status line has gone out (after that, errors can only go in-stream).
    """

    __slots__ = ("_receive", "_send", "_watch", "gone", "headers", "scope", "started")

    def __init__(self, scope: Scope, receive: Receive, send: Send):
        self.scope = scope
        self._receive = receive
        self._send = send
        # A case-insensitive multidict: `protocol.headers` reads it without copying.
        self.headers = CIMultiDict(
            [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
        )
        self.started = False
        self.gone = False  # the client disconnected while we were working
        self._watch: asyncio.TimerHandle | asyncio.Future | None = None

    @property
    def path(self) -> str:
        return self.scope["path"]

    @property
    def method(self) -> str:
        return self.scope["method"]

    async def body(self, cap: int) -> bytes:
        """The whole request body; BodyTooLarge past `cap` bytes, declared or counted."""
        declared = self.headers.get("content-length")
        length = int(declared) if declared is not None and declared.isdigit() else None
        if length is not None and length > cap:
            raise BodyTooLarge(length)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise BodyTooLarge(length)
            if not message.get("more_body", False):
                if not parts:
                    return chunk
                parts.append(chunk)
                return b"".join(parts)
            parts.append(chunk)

    def cancel_on_disconnect(self) -> None:
        """From now until `done()`, a client disconnect cancels the calling task (which closes
        the engine connection it is waiting on). Call after the body has been read.

        The waiter on `receive()` is a task, which costs more than the rest of a short
        request's own work; it starts only once the request has run for `WATCH_AFTER_S`, and
        a disconnect before then is seen as soon as it starts."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        self._watch = loop.call_later(WATCH_AFTER_S, self._start_watch, task)

    def _start_watch(self, task: asyncio.Task) -> None:
        watcher = self._watch = asyncio.ensure_future(self._receive())

        def disconnected(waiter: asyncio.Future) -> None:
            # The waiter also returns when the response completes; only a waiter still armed
            # (the handler not finished) means the client went away.
            if self._watch is waiter and not waiter.cancelled() and waiter.exception() is None:
                self.gone = True
                task.cancel()

        watcher.add_done_callback(disconnected)

    def done(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()

    async def respond(
        self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> None:
        await self.start(status, [*headers, (b"content-length", b"%d" % len(body))])
        await self._send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        """Send the status line and headers; without content-length the body goes chunked."""
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b""})


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: whoever runs the frontend stops it (the CLI on
    SIGTERM/SIGINT, tests on teardown); several frontends may share one process."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class AsgiServer:
    """uvicorn serving `app` in the running event loop."""

    def __init__(self, app: App):
        self.app = app
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self._socket: socket.socket | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); the port bound."""
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        config = uvicorn.Config(
            self.app,
            http="httptools",
            ws="none",
            lifespan="off",
            interface="asgi3",
            proxy_headers=False,  # Envoy's X-Forwarded-* mean nothing to the frontend
            server_header=False,
            access_log=False,
            log_config=None,  # logging is the CLI's
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=GRACEFUL_S,
        )
        self._socket = sock
        self._server = server = _Server(config)
        self._task = task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # startup is a few loop turns: no I/O but the bind above
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped while starting")
            await asyncio.sleep(0.005)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await self._task
        finally:
            self._server = self._task = None
            if self._socket is not None:
                self._socket.close()
                self._socket = None
