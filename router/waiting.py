"""Requests waiting for a worker: a bounded queue ordered by priority (Dynamo's router queue).

When every worker is busy (the `busy` filter refuses the request: `Overloaded`) and
`RouterConfig.queue_max_requests` > 0, a request waits here instead of getting the 503 at once.
The order: the highest GAIE InferenceObjective priority first (the objective the request names;
none = 0; GAIE's flow control always serves a higher priority first), then Dynamo's newest
order within it: the highest tier (`agent_hints.strict_priority`, none = 0),
then the earliest effective arrival, which is the arrival time moved earlier by the request's
priority jump in seconds (`nvext.priority_jump`, else `agent_hints.priority` clamped at 0, else
the deprecated `latency_sensitivity`: `NvExt.queue_order`). A request of a negative objective
priority is sheddable, as in GAIE: it never waits, and is refused at once (`Shed`, the caller's
429) while every worker is busy or others wait. Only the head is tried, so a request
never overtakes one ahead of it. It is tried again whenever a booking is freed
(`ActiveRequests.on_free`) and at least every `RETRY_S` (scraped load changes too). A request
that waits `queue_timeout_s` gets the busy 503 it would have had; a request finding the queue
full gets it at once. The waiting is the caller's: `RequestPipeline.decide` awaits it,
so the EPP and the frontend's kv mode queue alike. `QueueCollector` exposes what the queue did
as Prometheus metrics (the frontend's and the EPP's /metrics): depth per tier, the wait-time
histogram, and the refusals by reason.
"""

import asyncio
import bisect
import contextlib
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .errors import Overloaded

RETRY_S = 0.1  # the head is tried at least this often while it waits (load scrapes free room too)

R = TypeVar("R")  # what a successful attempt returns (the pipeline's `Routed`)
# upper bounds of the wait-time histogram, seconds
WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# why a request left the queue without a worker (label `reason` of the refusals)
REFUSALS = ("queue_full", "timed_out", "cancelled", "unroutable", "shed")


class Shed(Overloaded):
    """A sheddable request (negative objective priority) found every worker busy: refused
    without waiting (429, as GAIE's saturation detector answers)."""

    status = 429


@dataclass(order=True)
class _Entry(Generic[R]):
    key: tuple[int, int, float, int]  # (-objective priority, -tier, arrival - jump, order)
    attempt: Callable[[], R] = field(compare=False)
    future: "asyncio.Future[R]" = field(compare=False)
    tier: int = field(compare=False, default=0)
    priority: int = field(compare=False, default=0)


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
        # what happened, for metrics: by outcome; refusals by reason; dispatched waits
        self.outcomes: dict[str, int] = {"dispatched": 0, "timed_out": 0, "rejected": 0}
        self.refusals: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self.waited_s = 0.0  # summed over dispatched requests
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)  # per bucket (not cumulative), +Inf

    def depth_by_tier(self) -> dict[int, int]:
        """Requests waiting now, per tier (`agent_hints.strict_priority`)."""
        depths: dict[int, int] = {}
        for entry in self._heap:
            if not entry.future.done():
                depths[entry.tier] = depths.get(entry.tier, 0) + 1
        return depths

    def depth_by_objective_priority(self) -> dict[int, int]:
        """Requests waiting now, per InferenceObjective priority (none named = 0)."""
        depths: dict[int, int] = {}
        for entry in self._heap:
            if not entry.future.done():
                depths[entry.priority] = depths.get(entry.priority, 0) + 1
        return depths

    @property
    def depth(self) -> int:
        return sum(1 for e in self._heap if not e.future.done())

    def wake(self) -> None:
        """Room may have freed up: try the head now."""
        if self._wake is not None:
            self._wake.set()

    async def wait(
        self,
        attempt: Callable[[], R],
        tier: int,
        busy: Overloaded,
        jump_s: float = 0.0,
        priority: int = 0,
    ) -> R:
        """Queue a request the busy filter refused (`busy`) by its objective `priority` and
        `tier`, its arrival moved `jump_s` seconds earlier; its result once `attempt` succeeds.
        Raises `busy` when the queue is full or the wait times out, `Shed` at once for a
        sheddable request (`priority` < 0)."""
        if priority < 0:
            self.outcomes["rejected"] += 1
            self.refusals["shed"] += 1
            raise shed(busy, priority)
        if self.depth >= self.max_requests:
            self.outcomes["rejected"] += 1
            self.refusals["queue_full"] += 1
            raise Overloaded(
                f"{busy.reason}; the router's queue is full ({self.max_requests} requests)",
                busy.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        started = loop.time()
        key = (-priority, -tier, started - jump_s, next(self._arrivals))
        entry: _Entry[R] = _Entry(key, attempt, future, tier, priority)
        heapq.heappush(self._heap, entry)
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._run(), name="router-queue")
        try:
            result = await asyncio.wait_for(asyncio.shield(entry.future), self.timeout_s)
        except TimeoutError:
            if entry.future.done() and not entry.future.cancelled():
                return entry.future.result()  # dispatched as the timeout fired
            entry.future.cancel()
            self.outcomes["timed_out"] += 1
            self.refusals["timed_out"] += 1
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
            self.refusals["cancelled"] += 1
            raise
        except Exception:
            self.refusals["unroutable"] += 1
            raise
        waited = loop.time() - started
        self.waited_s += waited
        self.wait_counts[bisect.bisect_left(WAIT_BUCKETS, waited)] += 1
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


def shed(busy: Overloaded, priority: int) -> Shed:
    """The refusal of a sheddable request (objective `priority` < 0) that found `busy`."""
    return Shed(
        f"{busy.reason}; the request's InferenceObjective priority ({priority}) is sheddable",
        busy.retry_after_s,
    )


class QueueCollector(Collector):
    """The queue's state and outcomes as Prometheus metrics (`prefix`: the frontend's
    `dynamograph_router_queue`, the EPP's `dynamograph_epp_queue`)."""

    def __init__(self, queue: WaitQueue[Any], prefix: str = "dynamograph_router_queue") -> None:
        self.queue = queue
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        queue = self.queue
        yield GaugeMetricFamily(
            f"{self.prefix}_depth", "Requests waiting for a worker now", value=queue.depth
        )
        tiers = GaugeMetricFamily(
            f"{self.prefix}_depth_by_priority",
            "Requests waiting for a worker now, per priority tier (agent_hints.strict_priority)",
            labels=["priority"],
        )
        for tier, depth in sorted(queue.depth_by_tier().items()):
            tiers.add_metric([str(tier)], depth)
        yield tiers
        objectives = GaugeMetricFamily(
            f"{self.prefix}_depth_by_objective_priority",
            "Requests waiting for a worker now, per InferenceObjective priority (none named: 0)",
            labels=["priority"],
        )
        for priority, depth in sorted(queue.depth_by_objective_priority().items()):
            objectives.add_metric([str(priority)], depth)
        yield objectives
        requests = CounterMetricFamily(
            f"{self.prefix}_requests",
            "Requests that waited for a worker, by how the wait ended (dispatched, timed_out, "
            "rejected: the queue was full, or the request was sheddable)",
            labels=["outcome"],
        )
        for outcome, count in queue.outcomes.items():
            requests.add_metric([outcome], count)
        yield requests
        refused = CounterMetricFamily(
            f"{self.prefix}_refusals",
            "Requests that left the queue without a worker, by reason (queue_full, timed_out: "
            "both answered 503; cancelled: the client left; unroutable: no worker can take it "
            "any more; shed: a sheddable request, negative InferenceObjective priority, "
            "answered 429 without waiting)",
            labels=["reason"],
        )
        for reason, count in queue.refusals.items():
            refused.add_metric([reason], count)
        yield refused
        buckets, total = [], 0
        bounds = [repr(bound) for bound in WAIT_BUCKETS] + ["+Inf"]
        for bound, count in zip(bounds, queue.wait_counts, strict=True):
            total += count
            buckets.append((bound, total))
        yield HistogramMetricFamily(
            f"{self.prefix}_wait_seconds",
            "Time dispatched requests spent waiting in the queue",
            buckets=buckets,
            sum_value=queue.waited_s,
        )
