"""uvicorn serving an ASGI app inside the running event loop, on a socket we bind (port 0 works).

The frontend itself no longer runs on it (it has its own lean HTTP/1.1 server,
`http_server.py`); tests serve ASGI apps in-process with it (the vLLM middleware in
tests/worker).
"""

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

KEEP_ALIVE_S = 75  # idle connections stay open this long
GRACEFUL_S = 60.0  # on stop, requests in flight get this long to finish


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: whoever started it stops it; several servers may
    share one process."""

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
