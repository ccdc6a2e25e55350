"""What the worker's aiohttp server leaves open, closed: a clear answer to every malformed or
too-slow request, then the connection closed (the frontend's own server does the same, see
`frontend.http_server`).

aiohttp answers bad syntax with 400 but has no time limit on a request head or body (a
slow-loris or slow upload holds the connection for ever), serves any method a route takes or
says 404/405 for others (CONNECT, TRACE), answers HTTP/2.0 request lines as if HTTP/1.1, keeps
the connection after a 413, and waits for a declared-too-large body before refusing it.
`GuardedRequestHandler` runs every byte through an httptools (llhttp) parser of its own before
aiohttp sees it and refuses with a plain-text answer and a closed connection:

- 400: bad syntax (request line, header, framing, chunked coding); an HTTP/1.1 request without
  exactly one Host header;
- 408: a request head not complete `head_timeout` seconds after its first byte, a body not
  complete `body_timeout` seconds after its head;
- 413: a body over `max_body_bytes`, declared (at once) or counted;
- 414 / 431: a request line over `MAX_LINE`; a header field over `MAX_FIELD`, more than
  `MAX_HEADERS` of them, or a head over `MAX_HEAD` (below aiohttp's own limits, so the answer
  says which);
- 501: a method other than GET, HEAD and POST; a transfer-coding other than chunked;
- 505: an HTTP version other than 1.0 and 1.1 (HTTP/2 prior knowledge included).

The answer is written only when no answer to an earlier request is under way; the request
whose body was arriving ends as a client disconnect.
"""

import asyncio
import re
from typing import Any

import httptools
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

MAX_LINE = 8000  # request line (aiohttp's max_line_size is 8190)
MAX_FIELD = 8000  # one header field, name and value (aiohttp's max_field_size is 8190)
MAX_HEADERS = 100  # header fields (aiohttp's max_headers is 128; Envoy's default is 100)
MAX_HEAD = 64 * 1024  # the whole request head
METHODS = frozenset({"GET", "HEAD", "POST"})

_PLAIN = (
    b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parser_error_status(exc: Exception, data: bytes) -> int:
    """The status for an llhttp error: 501 for an unknown method in a well-formed request
    line, 505 for an HTTP version other than 1.x (and HTTP/2's preface), else 400."""
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        line = data.split(b"\r\n", 1)[0].split(b" ")
        well_formed = len(line) == 3 and line[2][:5] == b"HTTP/" and _TOKEN.fullmatch(line[0])
        return 501 if well_formed else 400
    if "HTTP version" in str(exc) or "PRI/Upgrade" in str(exc):
        return 505
    return 400


class _Shadow:
    """httptools' callbacks for one connection: tracks where the request is and checks it."""

    __slots__ = (
        "begun",
        "body",
        "deadline",
        "head",
        "headers",
        "in_body",
        "late",
        "limits",
        "parser",
        "url",
        "waited",
    )

    def __init__(self, limits: "Limits"):
        self.limits = limits
        self.parser = httptools.HttpRequestParser(self)
        self.begun = 0  # messages begun on the connection
        self.url = 0
        self.head = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = 0
        self.in_body = False
        self.deadline = 0.0
        self.late = ""
        self.waited = False  # the request's deadline passed while an earlier one was answered

    def on_message_begin(self) -> None:
        self.begun += 1
        self.waited = False
        self.url = self.head = self.body = 0
        self.headers = []
        self.late = f"request head not complete within {self.limits.head_timeout:g} s"
        self.deadline = self.limits.head_timeout

    def on_url(self, url: bytes) -> None:
        self.url += len(url)
        if self.url > MAX_LINE:
            raise Refused(414, f"request line over {MAX_LINE} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        self.head += size + 4
        self.headers.append((name.lower(), value))
        if size > MAX_FIELD:
            raise Refused(431, f"a header field over {MAX_FIELD} bytes")
        if len(self.headers) > MAX_HEADERS:
            raise Refused(431, f"more than {MAX_HEADERS} header fields")
        if self.head > MAX_HEAD:
            raise Refused(431, f"request head over {MAX_HEAD} bytes")

    def on_headers_complete(self) -> None:
        parser = self.parser
        method = parser.get_method().decode("ascii", "replace")
        if method not in METHODS:
            raise Refused(501, f"method {method} is not implemented")
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise Refused(505, f"HTTP/{version} is not supported (HTTP/1.1 is)")
        hosts = sum(1 for name, _ in self.headers if name == b"host")
        if version == "1.1" and hosts != 1:
            raise Refused(400, "an HTTP/1.1 request needs exactly one Host header")
        codings = {
            c.strip().lower()
            for name, value in self.headers
            if name == b"transfer-encoding"
            for c in value.split(b",")
        }
        if codings - {b"chunked"}:  # (llhttp has checked that chunked is the last one)
            listed = b", ".join(sorted(codings - {b"chunked"})).decode("latin-1")
            raise Refused(501, f"transfer-coding {listed} is not implemented")
        for name, value in self.headers:
            if name == b"content-length" and int(value) > self.limits.max_body_bytes:
                raise Refused(413, self._too_large())
        self.in_body = True
        self.waited = False
        self.late = f"request body not complete within {self.limits.body_timeout:g} s"
        self.deadline = self.limits.body_timeout

    def on_body(self, body: bytes) -> None:
        self.body += len(body)
        if self.body > self.limits.max_body_bytes:
            raise Refused(413, self._too_large())

    def on_message_complete(self) -> None:
        self.in_body = False
        self.deadline = 0.0  # (0: no deadline; otherwise seconds from now, see `_arm`)

    def _too_large(self) -> str:
        return f"request body over the worker's limit of {self.limits.max_body_bytes} bytes"


class Limits:
    def __init__(self, *, max_body_bytes: int, head_timeout: float, body_timeout: float):
        self.max_body_bytes = max_body_bytes
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol behind the checks above."""

    __slots__ = ("_guard", "_late_handle")

    def __init__(self, manager: web.Server, *, limits: Limits, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._guard = _Shadow(limits)
        self._late_handle: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close or not data:
            super().data_received(data)
            return
        guard = self._guard
        guard.deadline = -1.0  # (-1: unchanged by this read)
        try:
            guard.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if not isinstance(refused, Refused):
                raise
            self._refuse(refused.status, refused.message)
            return
        except httptools.HttpParserUpgrade:
            pass  # CONNECT was refused above; other upgrades: aiohttp serves the request
        except httptools.HttpParserError as exc:
            message = f"Invalid HTTP request received: {exc}"
            self._refuse(parser_error_status(exc, data), message)
            return
        if guard.deadline >= 0:
            self._arm(guard.deadline)
        super().data_received(data)

    def _arm(self, seconds: float) -> None:
        if self._late_handle is not None:
            self._late_handle.cancel()
            self._late_handle = None
        if seconds > 0:
            self._late_handle = self._loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._late_handle = None
        guard = self._guard
        budget = guard.limits.body_timeout if guard.in_body else guard.limits.head_timeout
        if not self._answerable():
            # A pipelined request waits while an earlier one is answered: no 408 that would
            # cut that answer short; looked at again shortly.
            guard.waited = True
            self._arm(min(0.1, budget))
            return
        if guard.waited:  # its turn came: its time starts now (aiohttp may not have read)
            guard.waited = False
            self._arm(budget)
            return
        self._refuse(408, guard.late)

    def _answerable(self) -> bool:
        """Whether a refusal can be written as the answer to the request it concerns: no
        request is being answered, or it is the one whose body is arriving and nothing of
        its answer has gone out."""
        request = self._current_request
        if request is None:
            return True
        guard = self._guard
        handled = self._request_count - len(self._messages)  # aiohttp's, 1-based
        return guard.in_body and guard.begun == handled and request.writer.output_size == 0

    def _refuse(self, status: int, message: str) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._answerable():
            body = message.encode()
            phrase = _reason(status)
            transport.write(_PLAIN % (status, phrase, len(body), body))
        self._arm(0)
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._arm(0)
        super().connection_lost(exc)


def _reason(status: int) -> bytes:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def serve(
    runner: web.AppRunner, host: str, port: int, limits: Limits
) -> tuple[asyncio.AbstractServer, int]:
    """Listen on host:port (0: a free port) with guarded connections of `runner`'s server
    (set up already); the asyncio server (close it before `runner.cleanup()`) and the port."""
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()
    kwargs = server._kwargs  # what aiohttp's own Server.__call__ builds its handlers with

    def factory() -> GuardedRequestHandler:
        return GuardedRequestHandler(server, loop=loop, limits=limits, **kwargs)

    listening = await loop.create_server(factory, host, port, reuse_address=True, backlog=1024)
    return listening, listening.sockets[0].getsockname()[1]
