"""Per-mode choice of the engines for a request: `direct` and `round-robin` (kv lives in kv_mode).

A picker turns the request's pins into a `Route` of discovered workers. Pins always win: a
request that names its workers goes there in every mode, as the seed's direct router does.
"""

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from dynamograph.protocol.engine import Role
from dynamograph.protocol.nvext import NvExt
from dynamograph.protocol.openai import OpenAIError
from dynamograph.router.discovery import WorkerRecord

from .directory import DECODE_ROLES, WorkerDirectory
from .routing import Mode, Pins, Target, check_pins

NO_PREFILL_WORKERS = (
    "disaggregated serving is enforced (--enforce-disagg) but no prefill workers are "
    "discovered; start prefill workers or drop --enforce-disagg to serve aggregated"
)


class Booking(Protocol):
    """A router's hold on a worker for one request (kv mode); freed when the request ends."""

    def mark_prefill_done(self) -> None: ...

    def accepted(self) -> None:
        """The decode engine answered with a success status (an `open` session binds)."""
        ...

    def add_output_tokens(self, tokens: int) -> None:
        """Tokens streamed so far: an expected output (`agent_hints.osl`) decays by them."""
        ...

    def free(self) -> None: ...


@dataclass(slots=True)
class Route:
    decode: WorkerRecord
    decode_target: Target
    prefill: WorkerRecord | None = None
    prefill_target: Target | None = None
    booking: Booking | None = None
    # a query-only request (`query_instance_id` annotation): the response body to answer with
    # instead of calling an engine (`router.pipeline.query_answer`)
    query_answer: bytes | None = None


class RoutingMode(Protocol):
    mode: Mode

    async def pick(self, pins: Pins, nvext: NvExt | None, path: str, body: dict[str, Any]) -> Route:
        """The route for a request; OpenAIError (400/503) when there is none."""
        ...

    def refresh(self) -> None:
        """Catch up now on what the next pick would read first (kv: the queued KV events): the
        frontend calls it once a streaming engine's response head is in (it is then
        prefilling), or once a whole answer has gone to the client."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def pinned_route(directory: WorkerDirectory, pins: Pins) -> Route:
    """The route a fully pinned request names (both legs resolved; errors name the leg)."""
    assert pins.decode is not None
    route = Route(directory.resolve(pins.decode, "decode"), pins.decode)
    if pins.prefill is not None:
        route.prefill = directory.resolve(pins.prefill, "prefill")
        route.prefill_target = pins.prefill
    return route


class _NoFeeds:
    """A mode fed by nothing but its directory: nothing to start, stop or catch up on."""

    def refresh(self) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class DirectMode(_NoFeeds):
    """The endpoint picker decided: forward where the headers say, refuse what names nobody."""

    mode = Mode.DIRECT

    def __init__(self, directory: WorkerDirectory, *, enforce_disagg: bool):
        self.directory = directory
        self.enforce_disagg = enforce_disagg

    async def pick(self, pins: Pins, nvext: NvExt | None, path: str, body: dict[str, Any]) -> Route:
        # No prefill pin means aggregated, even with prefill workers discovered here: the picker
        # routes aggregated when it has no ready one (it drops a worker whose scrapes fail, which
        # this discovery does not see), and decode engines prefill themselves without
        # kv_transfer_params. Graphs whose decode engines must not prefill run --enforce-disagg.
        check_pins(pins, self.mode, enforce_disagg=self.enforce_disagg)
        return pinned_route(self.directory, pins)


class RoundRobinMode(_NoFeeds):
    """Cycles through every (worker, DP rank) of the graph; disaggregated when prefill
    workers exist, aggregated otherwise (unless `enforce_disagg`)."""

    mode = Mode.ROUND_ROBIN

    def __init__(self, directory: WorkerDirectory, *, enforce_disagg: bool):
        self.directory = directory
        self.enforce_disagg = enforce_disagg
        self._turns = {"decode": itertools.count(), "prefill": itertools.count()}

    def _next(self, leg: str, roles: tuple[Role, ...]) -> tuple[WorkerRecord, Target] | None:
        slots = [
            (record, rank)
            for record in self.directory.with_roles(roles)
            for rank in range(record.config.data_parallel_size)
        ]
        if not slots:
            return None
        record, rank = slots[next(self._turns[leg]) % len(slots)]
        dp_rank = rank if record.config.data_parallel_size > 1 else None
        return record, Target(record.instance_id, dp_rank)

    async def pick(self, pins: Pins, nvext: NvExt | None, path: str, body: dict[str, Any]) -> Route:
        if pins.decode is not None:
            route = Route(self.directory.resolve(pins.decode, "decode"), pins.decode)
        else:
            chosen = self._next("decode", DECODE_ROLES)
            if chosen is None:
                raise OpenAIError(503, "no decode or aggregated workers are discovered yet")
            route = Route(*chosen)
        if pins.prefill is not None:
            route.prefill = self.directory.resolve(pins.prefill, "prefill")
            route.prefill_target = pins.prefill
        else:
            chosen = self._next("prefill", (Role.PREFILL,))
            if chosen is not None:
                route.prefill, route.prefill_target = chosen
            elif self.enforce_disagg:
                raise OpenAIError(503, NO_PREFILL_WORKERS)
        return route
