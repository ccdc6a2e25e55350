"""Response-side `nvext`: `worker_id` and `timing` when the client asks via `extra_fields` (pure).

Only requests that ask pay for it. A non-streaming answer is parsed, given its `nvext` and
re-serialised; a stream passes through untouched except that the last JSON event before
`data: [DONE]` (the final chunk) is held back one event and re-written with the `nvext` added.
"""

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from dynamograph.protocol.nvext import NvExt, NvExtResponse, TimingInfo, WorkerIdInfo

from .routing import Target

WORKER_ID = "worker_id"
TIMING = "timing"


@dataclass(slots=True)
class Trace:
    """What happened to one request, for `nvext.timing`/`nvext.worker_id` and the metrics."""

    received_ms: float  # wall clock, ms since the epoch
    start: float  # time.perf_counter() at arrival
    decode: Target | None = None
    prefill: Target | None = None
    prefill_s: float | None = None  # duration of the prefill leg
    first_token_s: float | None = None  # arrival → first response byte of the decode leg
    stream_error: int | None = None  # status of an engine failure after the stream had begun

    @classmethod
    def begin(cls) -> "Trace":
        return cls(received_ms=time.time() * 1000.0, start=time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def wanted(nvext: NvExt | None) -> bool:
    return nvext is not None and (nvext.wants(WORKER_ID) or nvext.wants(TIMING))


def response_nvext(nvext: NvExt, trace: Trace, usage: Any) -> dict[str, Any]:
    """The `nvext` object of a response, holding only the fields the request asked for."""
    out = NvExtResponse()
    if nvext.wants(WORKER_ID):
        out.worker_id = WorkerIdInfo(
            prefill_worker_id=trace.prefill.worker_id if trace.prefill else None,
            prefill_dp_rank=trace.prefill.dp_rank if trace.prefill else None,
            decode_worker_id=trace.decode.worker_id if trace.decode else None,
            decode_dp_rank=trace.decode.dp_rank if trace.decode else None,
        )
    if nvext.wants(TIMING):
        usage = usage if isinstance(usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        total = trace.elapsed()
        out.timing = TimingInfo(
            request_received_ms=trace.received_ms,
            prefill_time_ms=_ms(trace.prefill_s),
            ttft_ms=_ms(trace.first_token_s if trace.first_token_s is not None else total),
            total_time_ms=_ms(total),
            cached_tokens=cached if isinstance(cached, int) else None,
            prompt_tokens=usage.get("prompt_tokens")
            if isinstance(usage.get("prompt_tokens"), int)
            else None,
        )
    return out.model_dump(mode="json")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def add_to_json(obj: Any, ext: Callable[[Any], dict[str, Any]]) -> Any:
    """Merge `ext(usage)` into a response object's `nvext` (keeping any the engine set)."""
    if isinstance(obj, dict):
        merged = dict(obj.get("nvext") or {})
        merged.update(ext(obj.get("usage")))
        obj["nvext"] = merged
    return obj


def add_to_body(raw: bytes, ext: Callable[[Any], dict[str, Any]]) -> bytes:
    """A non-streaming response body with `nvext` added; bodies that are not JSON pass as sent."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    return orjson.dumps(add_to_json(obj, ext))


_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DONE = b"[DONE]"


def _data(event: bytes) -> bytes | None:
    """The payload of an event's data line (our engines send one data line per event)."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


class FinalChunkInjector:
    """Re-writes the last JSON event of an SSE stream to carry `nvext`; everything else as is.

    `feed` returns the bytes that may go to the client now; `close` the rest at end of stream
    (for streams that end without `[DONE]`).
    """

    def __init__(self, ext: Callable[[Any], dict[str, Any]]):
        self._ext = ext
        self._buffer = b""
        self._held: bytes | None = None  # the latest JSON event, raw
        self._done = False

    def feed(self, chunk: bytes) -> bytes:
        if self._done:
            return chunk
        self._buffer += chunk
        out: list[bytes] = []
        pos = 0
        for match in _EVENT_END.finditer(self._buffer):
            event = self._buffer[pos : match.end()]
            pos = match.end()
            payload = _data(event)
            if payload == _DONE:
                out.append(self._release())
                out.append(event)
                out.append(self._buffer[pos:])
                self._buffer = b""
                self._done = True
                return b"".join(out)
            if payload is not None and payload.startswith(b"{"):
                if self._held is not None:
                    out.append(self._held)
                self._held = event
            else:  # comments and other events are not the final chunk: pass them on
                out.append(event)
        self._buffer = self._buffer[pos:]
        return b"".join(out)

    def close(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        rest, self._buffer = self._buffer, b""
        return self._release() + rest

    def _release(self) -> bytes:
        held, self._held = self._held, None
        if held is None:
            return b""
        try:
            obj = orjson.loads(_data(held) or b"")
        except orjson.JSONDecodeError:
            return held
        return b"data: " + orjson.dumps(add_to_json(obj, self._ext)) + b"\n\n"
