"""The engine lifecycle every worker implements, and the stream contract it promises.

The seed's `LLMEngine` in Python: `start(worker_id) -> EngineConfig`, `generate(request, ctx)` as
an async stream of `EngineOutput` chunks that ends with exactly one terminal chunk (finish reason
stop / length / cancelled / error), `abort`, `drain` and `cleanup` (idempotent, and safe after a
failed or missing start). `validate_stream` checks the contract; tests run every stream through it.
"""

import abc
import asyncio
import enum
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynamograph.protocol.engine import EngineConfig
from dynamograph.protocol.nvext import NvExt


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class GenerateRequest:
    """One tokenized request as the engine sees it (the HTTP layer builds it)."""

    request_id: str
    prompt_tokens: np.ndarray
    max_tokens: int
    seed: int | None = None
    dp_rank: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    nvext: NvExt | None = None
    lora_name: str | None = None  # the LoRA adapter the request's `model` names
    lora_id: int | None = None  # its vLLM id (set by the engine that serves the adapter)
    priority: int = 0  # vLLM's request priority: lower runs first (`--scheduling-policy priority`)
    # A non-streamed request (vLLM's RequestOutputKind.FINAL_ONLY): its reader is woken for the
    # first token and the last, not for every token in between (they are merged meanwhile).
    final_only: bool = False


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Timing:
    """Simulated seconds: what the modelled GPU would have taken (`worker/cost.py`, docs/worker.md)."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None
    queue_time: float = 0.0
    prefill_time: float = 0.0
    transfer_time: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(slots=True)
class EngineOutput:
    """A chunk of the stream: new tokens and text, and on the last chunk why it ended."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    dp_rank: int | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None


class OutputCollector:
    """The undelivered output of one request, merged while the reader lags (as vLLM's
    RequestOutputCollector): a slow client gets fewer, larger chunks instead of a backlog.

    `final_only` (a reader that wants the whole answer): the reader is woken for the first
    output, which tells it when the first token came, and then for the terminal one only; waking
    a task per token it would merely append costs more than the rest of the token's work."""

    def __init__(self, *, final_only: bool = False) -> None:
        self._out: EngineOutput | None = None
        self._ready = asyncio.Event()
        self._wake_each = not final_only
        self._woken = False  # final_only: the first output has woken the reader

    def put(self, out: EngineOutput) -> None:
        pending = self._out
        if pending is None:
            self._out = out
        else:
            pending.token_ids.extend(out.token_ids)
            pending.text += out.text
            pending.finish_reason = out.finish_reason
            pending.error = out.error
            pending.usage = out.usage
            pending.timing = out.timing
            pending.kv_transfer_params = out.kv_transfer_params
        if self._wake_each or not self._woken or out.finish_reason is not None:
            self._woken = True
            self._ready.set()

    async def get(self) -> EngineOutput:
        while self._out is None:
            self._ready.clear()
            await self._ready.wait()
        out, self._out = self._out, None
        return out


class RequestContext:
    """Per-request cancellation shared between the caller and the engine."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._cancelled = asyncio.Event()
        self._callbacks: list = []

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        for callback in self._callbacks:
            callback()

    def on_cancel(self, callback) -> None:
        """Run `callback()` when the request is cancelled (at once if it already is)."""
        if self._cancelled.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class EngineError(Exception):
    """A request the engine refuses before it starts (bad rank, prompt too long, ...)."""

    def __init__(self, status: int, message: str, *, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class LLMEngine(abc.ABC):
    """Lifecycle: start once, generate many, drain, cleanup (any number of times)."""

    @abc.abstractmethod
    async def start(self, worker_id: int) -> EngineConfig:
        """Bring the engine up and say what it is; raise on failure (cleanup stays safe)."""

    @abc.abstractmethod
    def generate(
        self, request: GenerateRequest, ctx: RequestContext
    ) -> AsyncGenerator[EngineOutput, None]:
        """Stream outputs; the last chunk, and only it, carries a finish reason.

        Refusals that happen before any work (EngineError) are raised on the first iteration.
        Closing the iterator early, or cancelling `ctx`, aborts the request and frees its blocks.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Cancel a running request; its stream ends with `cancelled`. False when unknown."""

    @abc.abstractmethod
    async def drain(self, grace: float | None = None) -> None:
        """Refuse new requests and wait (up to `grace` seconds) for in-flight ones to finish."""

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Release every resource. Idempotent; safe when start failed or never ran."""


class StreamContractError(AssertionError):
    pass


def validate_stream(chunks: Iterable[EngineOutput], *, max_tokens: int | None = None) -> Usage:
    """Check a finished stream against the contract; return its final usage.

    Exactly one terminal chunk, and it is last; errors carry a message; the usage on the
    terminal chunk counts the tokens streamed before it; never more than max_tokens.
    """
    chunks = list(chunks)
    if not chunks:
        raise StreamContractError("stream ended without a terminal chunk")
    terminal = [i for i, c in enumerate(chunks) if c.is_terminal]
    if len(terminal) != 1:
        raise StreamContractError(f"expected exactly one terminal chunk, got {len(terminal)}")
    if terminal[0] != len(chunks) - 1:
        raise StreamContractError(f"terminal chunk at {terminal[0]} is not last ({len(chunks)})")
    last = chunks[-1]
    if not isinstance(last.finish_reason, FinishReason):
        raise StreamContractError(f"unknown finish reason {last.finish_reason!r}")
    if last.finish_reason is FinishReason.ERROR and not last.error:
        raise StreamContractError("an error chunk must say what went wrong")
    streamed = sum(len(c.token_ids) for c in chunks)
    if last.usage is None:
        raise StreamContractError("terminal chunk carries no usage")
    if last.usage.completion_tokens != streamed:
        raise StreamContractError(
            f"usage says {last.usage.completion_tokens} tokens, stream carried {streamed}"
        )
    if not 0 <= last.usage.cached_tokens <= last.usage.prompt_tokens:
        raise StreamContractError(f"cached tokens out of range: {last.usage}")
    if max_tokens is not None and streamed > max_tokens:
        raise StreamContractError(f"{streamed} tokens streamed, max_tokens was {max_tokens}")
    return last.usage


async def collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [chunk async for chunk in stream]
