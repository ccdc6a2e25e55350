"""Requests waiting for a worker: a bounded queue ordered by priority (Dynamo's router queue).

When every worker is busy (the `busy` filter refuses the request: `Overloaded`) and
`RouterConfig.queue_max_requests` > 0, a request waits here instead of getting the 503 at once:
the highest `agent_hints.priority` first (higher = more important, as Dynamo; none = 0), then
arrival order. Only the head is tried, so a request never overtakes a more important (or, at
equal priority, an earlier) one. It is tried again whenever a booking is freed
(`ActiveRequests.on_free`) and at least every `RETRY_S` (scraped load changes too). A request
that waits `queue_timeout_s` gets the busy 503 it would have had; a request finding the queue
full gets it at once. The waiting is the caller's: `RequestPipeline.decide` awaits it,
so the EPP and the frontend's kv mode queue alike. `QueueCollector` exposes what the queue did
as Prometheus metrics (the frontend's /metrics).
"""

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .errors import Overloaded

RETRY_S = 0.1  # the head is tried at least this often while it waits (load scrapes free room too)

R = TypeVar("R")  # what a successful attempt returns (the pipeline's `Routed`)


@dataclass(order=True)
class _Entry(Generic[R]):
    key: tuple[int, int]  # (-priority, arrival)
    attempt: Callable[[], R] = field(compare=False)
    future: "asyncio.Future[R]" = field(compare=False)


class WaitQueue(Generic[R]):
    """The bounded priority queue (module docstring). `attempt` raises `Overloaded` while every
    worker is busy; any other exception ends that request's wait with it."""

    def __init__(
        self, max_requests: int, timeout_s: float, release: Callable[[R], None] | None = None
    ) -> None:
        self.max_requests = max_requests
        self.timeout_s = timeout_s
        self._release = release  # undoes a result nobody waits for any more (frees a booking)
        self._heap: list[_Entry[R]] = []
        self._arrivals = itertools.count()
        self._wake: asyncio.Event | None = None
        self._pump: asyncio.Task[None] | None = None
        # what happened, for metrics: by outcome, and by priority for the dispatched
        self.outcomes: dict[str, int] = {"dispatched": 0, "timed_out": 0, "rejected": 0}
        self.waited_s = 0.0  # summed over dispatched requests

    @property
    def depth(self) -> int:
        return sum(1 for e in self._heap if not e.future.done())

    def wake(self) -> None:
        """Room may have freed up: try the head now."""
        if self._wake is not None:
            self._wake.set()

    async def wait(self, attempt: Callable[[], R], priority: int, busy: Overloaded) -> R:
        """Queue a request the busy filter refused (`busy`); its result once `attempt`
        succeeds. Raises `busy` when the queue is full or the wait times out."""
        if self.depth >= self.max_requests:
            self.outcomes["rejected"] += 1
            raise Overloaded(
                f"{busy.reason}; the router's queue is full ({self.max_requests} requests)",
                busy.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        entry: _Entry[R] = _Entry((-priority, next(self._arrivals)), attempt, future)
        heapq.heappush(self._heap, entry)
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._run(), name="router-queue")
        started = loop.time()
        try:
            result = await asyncio.wait_for(asyncio.shield(entry.future), self.timeout_s)
        except TimeoutError:
            if entry.future.done() and not entry.future.cancelled():
                return entry.future.result()  # dispatched as the timeout fired
            entry.future.cancel()
            self.outcomes["timed_out"] += 1
            raise Overloaded(
                f"{busy.reason}; waited {self.timeout_s:g} s in the router's queue",
                busy.retry_after_s,
            ) from None
        except asyncio.CancelledError:
            # the caller went away: the pump skips it, or what it was given is released
            given = entry.future.done() and not entry.future.cancelled()
            if given and self._release is not None:
                self._release(entry.future.result())
            entry.future.cancel()
            raise
        self.waited_s += loop.time() - started
        return result

    async def _run(self) -> None:
        assert self._wake is not None
        while self._heap:
            entry = self._heap[0]
            if entry.future.done():  # timed out or cancelled
                heapq.heappop(self._heap)
                continue
            try:
                result = entry.attempt()
            except Overloaded:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RETRY_S)
                continue
            except Exception as exc:  # the request cannot be routed any more: say why
                heapq.heappop(self._heap)
                entry.future.set_exception(exc)
                continue
            heapq.heappop(self._heap)
            entry.future.set_result(result)
            self.outcomes["dispatched"] += 1
            await asyncio.sleep(0)  # let the dispatched request start before the next try

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()


class QueueCollector(Collector):
    """The queue's state and outcomes as Prometheus metrics."""

    def __init__(self, queue: WaitQueue[Any], prefix: str = "dynamograph_router_queue") -> None:
        self.queue = queue
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        queue = self.queue
        yield GaugeMetricFamily(
            f"{self.prefix}_depth", "Requests waiting for a worker now", value=queue.depth
        )
        requests = CounterMetricFamily(
            f"{self.prefix}_requests",
            "Requests that waited for a worker, by how the wait ended (dispatched, timed_out, "
            "rejected: the queue was full)",
            labels=["outcome"],
        )
        for outcome, count in queue.outcomes.items():
            requests.add_metric([outcome], count)
        yield requests
        yield CounterMetricFamily(
            f"{self.prefix}_wait_seconds",
            "Time dispatched requests spent waiting in the queue",
            value=queue.waited_s,
        )
