"""The router core's public face: workers in, KV events in, `schedule(RouteRequest) -> Decision` out.

DESIGN §3.5/§3.6 (seeds: Dynamo's kv_push_router.rs, prefill_router, sticky sessions). The
`Router` owns the KV index (`index.KvIndex`), the active-request books (`active.ActiveRequests`)
and the worker table; selection itself is the plugin pipeline of `plugins.py` (filters →
scorers → picker). Pure in-process logic: no I/O, no clocks except the injected one, so the EPP
and the frontend's `kv` mode drive it the same way:

    router = Router(RouterConfig(...))
    router.add_worker(wid, role=Role.AGGREGATED, dp_size=1, block_size=16, total_blocks=8192)
    gap = router.apply_kv_batch(wid, seq, batch)          # from the ZMQ subscriber
    router.update_load(wid, 0, waiting=2, running=5, kv_usage=0.4)   # from /metrics
    decision = router.schedule(RouteRequest(request_id, block_hashes, isl_tokens))
    with decision.guard:                                  # None for query-only requests
        ... first token → decision.guard.mark_prefill_done() ...

Errors are exceptions carrying the HTTP status a caller should answer with:
`NoEligibleWorker` (503, with the reason) and `Overloaded` (429, with Retry-After).
"""

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dynamograph.protocol.engine import Role
from dynamograph.protocol.headers import RoutingHeaders
from dynamograph.protocol.kv_events import EventBatch
from dynamograph.protocol.nvext import NvExt, SessionAction, SessionControl

from .active import RequestGuard, Slot
from .config import RouterConfig
from .seqtrack import GapInfo

log = logging.getLogger(__name__)


class RoutingError(Exception):
    """Base of the scheduler's refusals; `status` is the HTTP status to answer with."""

    status = 500


class NoEligibleWorker(RoutingError):
    """No worker can take the request (503); `reason` says why, for the error body."""

    status = 503

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Overloaded(RoutingError):
    """Every eligible worker is saturated (429); retry after `retry_after_s` seconds."""

    status = 429

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class RoutePins:
    """Explicit placement from headers or nvext; a pinned phase bypasses selection."""

    worker_id: int | None = None
    dp_rank: int | None = None
    prefill_worker_id: int | None = None
    prefill_dp_rank: int | None = None

    @classmethod
    def from_nvext(cls, nvext: NvExt | None) -> "RoutePins":
        """Pins from an nvext (apply `headers.apply_header_routing_overrides` first)."""
        if nvext is None:
            return cls()
        worker = nvext.decode_worker_id
        if worker is None:
            worker = nvext.backend_instance_id
        return cls(worker, nvext.dp_rank, nvext.prefill_worker_id, nvext.prefill_dp_rank)

    @classmethod
    def from_headers(cls, headers: RoutingHeaders) -> "RoutePins":
        return cls(
            headers.worker_id, headers.dp_rank, headers.prefill_worker_id, headers.prefill_dp_rank
        )


@dataclass(slots=True)
class RouteRequest:
    """What the scheduler needs to know about one request.

    `block_hashes` are `protocol.hashing.block_hashes(tokens, router.block_size, lora_name)`.
    """

    request_id: str
    block_hashes: Sequence[int]
    isl_tokens: int
    lora_name: str | None = None
    pins: RoutePins = field(default_factory=RoutePins)
    session: SessionControl | None = None
    allowed_ids: frozenset[int] | None = None  # e.g. the GAIE subset hint, as instance ids
    expected_output_tokens: int | None = None  # nvext.agent_hints.osl
    query_only: bool = False  # decide, but book nothing and record nothing


@dataclass(frozen=True, slots=True)
class Pick:
    worker_id: int
    dp_rank: int
    overlap_blocks: int  # prompt blocks already cached on this slot
    cost: float | None = None  # the KV policy's cost; None when pinned or not costed
    pinned: bool = False
    sticky: bool = False


@dataclass(slots=True)
class Decision:
    """Where a request goes. `prefill` is set only for a disaggregated decision."""

    decode: Pick
    prefill: Pick | None = None
    guard: RequestGuard | None = None  # None for query-only requests
    fallback_reason: str | None = None  # why a disaggregated pool served aggregated

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


@dataclass(slots=True)
class WorkerState:
    """What the router knows about one worker (all of its DP ranks)."""

    worker_id: int
    role: Role
    dp_size: int
    block_size: int
    total_blocks: int
    lora_names: frozenset[str]
    ready: bool = True
    # per dp rank, from /metrics scrapes
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)


class Router:
    """Worker table + KV index + active requests + the plugin pipeline."""

    def __init__(
        self, config: RouterConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        raise NotImplementedError

    # -- workers -------------------------------------------------------------------------
    def add_worker(
        self,
        worker_id: int,
        *,
        role: Role = Role.AGGREGATED,
        dp_size: int = 1,
        block_size: int,
        total_blocks: int,
        lora_names: Mapping[int, str] | Iterable[str] = (),
    ) -> None:
        """Register (or update) a worker. `lora_names`: the adapters it serves, as a mapping
        vLLM lora_id → name, or names in load order (ids 1, 2, …, vLLM's assignment). All
        workers must share one block size (ValueError otherwise)."""
        raise NotImplementedError

    def remove_worker(self, worker_id: int) -> None:
        """Forget a worker: its index state, sequence tracking, sessions and booked load."""
        raise NotImplementedError

    def set_ready(self, worker_id: int, ready: bool) -> None:
        raise NotImplementedError

    def update_load(
        self,
        worker_id: int,
        dp_rank: int = 0,
        *,
        waiting: int | None = None,
        running: int | None = None,
        kv_usage: float | None = None,
    ) -> None:
        """Scraped engine metrics (vllm:num_requests_waiting/running, kv_cache_usage_perc)."""
        raise NotImplementedError

    @property
    def block_size(self) -> int | None:
        """The fleet's KV block size (None before the first worker): hash requests with it."""
        raise NotImplementedError

    def workers(self) -> dict[int, WorkerState]:
        raise NotImplementedError

    # -- KV events -----------------------------------------------------------------------
    def apply_kv_batch(self, worker_id: int, seq: int, batch: EventBatch) -> GapInfo | None:
        """Apply one ZMQ batch in sequence order. Returns GapInfo when batches were missed: the
        caller replays from `gap.start_seq` (feeding the replayed batches here); if replay
        cannot fill the gap, it calls `replay_failed`."""
        raise NotImplementedError

    def replay_failed(self, worker_id: int, dp_rank: int | None = None) -> None:
        """Replay could not fill a gap: clear that worker's (rank's) blocks and restart tracking."""
        raise NotImplementedError

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self, request: RouteRequest) -> Decision:
        """Pick decode (and, disaggregated, prefill) slots and book them unless query-only.

        Raises NoEligibleWorker (503) or Overloaded (429)."""
        raise NotImplementedError


__all__ = [
    "Decision",
    "GapInfo",
    "NoEligibleWorker",
    "Overloaded",
    "Pick",
    "RoutePins",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RoutingError",
    "SessionAction",
    "Slot",
    "WorkerState",
    "log",
    "random",
]
