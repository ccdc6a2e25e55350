"""Where a request goes, decided from what it names: routing headers merged into `nvext` (pure).

The endpoint picker writes its decision into routing headers; `protocol.headers` merges them
into the body's `nvext` (headers win). This module turns the merged `nvext` into the engines the
request pins (decode, and prefill for the disaggregated hand-off) and enforces the rules of the
frontend's modes. No I/O: the server resolves the pinned ids to discovered engines.
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from dynamograph.protocol.headers import (
    ALL_ROUTING_HEADERS,
    PREFILL_INSTANCE_ID,
    WORKER_INSTANCE_ID,
    RoutingHeaders,
    apply_header_routing_overrides,
    parse_routing_headers,
)
from dynamograph.protocol.nvext import NvExt
from dynamograph.protocol.openai import OpenAIError
from dynamograph.protocol.pins import RoutePins


class Mode(StrEnum):
    DIRECT = "direct"  # the endpoint picker chose; a request without a worker id is refused
    KV = "kv"  # no picker in front: the frontend runs the router core itself
    ROUND_ROBIN = "round-robin"  # no picker in front: cycle through the discovered workers


@dataclass(frozen=True, slots=True)
class Target:
    """One engine to call: its instance id and, for data-parallel engines, the rank."""

    worker_id: int
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Pins:
    """The engines a request names itself (via headers or nvext); None where it names none."""

    decode: Target | None = None
    prefill: Target | None = None


NO_PINS = Pins()

WORKER_ID_REQUIRED = (
    f"Worker ID required: this frontend runs in direct mode and expected {WORKER_INSTANCE_ID} "
    "set by the endpoint picker (or nvext.backend_instance_id / nvext.decode_worker_id in the "
    "body); send the request through the gateway, or start the frontend with --mode kv or "
    "--mode round-robin to pick a worker itself"
)
PREFILL_ID_REQUIRED = (
    "disaggregated serving is enforced (--enforce-disagg) but the request names no prefill "
    f"worker: expected {PREFILL_INSTANCE_ID} set by the endpoint picker (or "
    "nvext.prefill_worker_id in the body)"
)


def _from_route(route: RoutePins) -> Pins:
    # The router core owns the rule "decode = decode_worker_id, else backend_instance_id";
    # a DP rank without its worker id names nothing.
    decode = Target(route.worker_id, route.dp_rank) if route.worker_id is not None else None
    prefill = (
        Target(route.prefill_worker_id, route.prefill_dp_rank)
        if route.prefill_worker_id is not None
        else None
    )
    return Pins(decode, prefill) if decode is not None or prefill is not None else NO_PINS


def read_pins(nvext: NvExt | None) -> Pins:
    """The decode and prefill targets named by a (header-merged) nvext."""
    return _from_route(RoutePins.from_nvext(nvext))


# The routing headers of a fleet take few distinct values (one per worker and rank), so their
# parse and the pins they give are memoised: together they were ~15% of the hop's instructions.
_MEMO = 4096


def routing_headers(headers: Mapping[str, str]) -> RoutingHeaders:
    """`protocol.headers.parse_routing_headers(headers)` for a case-insensitive mapping (the
    server's request headers), memoised on the raw values of the routing headers."""
    return _parse_values(tuple(map(headers.get, ALL_ROUTING_HEADERS)))


@functools.lru_cache(maxsize=_MEMO)
def _parse_values(values: tuple[str | None, ...]) -> RoutingHeaders:
    present = {name: v for name, v in zip(ALL_ROUTING_HEADERS, values, strict=True) if v}
    return parse_routing_headers(present)


@functools.lru_cache(maxsize=_MEMO)
def pins_from_headers(routing: RoutingHeaders) -> Pins:
    """`read_pins(apply_header_routing_overrides(None, routing))` without building an NvExt:
    the hot path of requests whose body has no nvext (a test keeps the two equal)."""
    return _from_route(RoutePins.from_headers(routing))


def merge(nvext: NvExt | None, routing: RoutingHeaders) -> tuple[NvExt | None, Pins]:
    """Headers merged into the body's nvext (headers win, as the seed) and the pins that gives."""
    if nvext is None:
        pins = pins_from_headers(routing)
        if (routing.dp_rank is None or pins.decode is not None) and (
            routing.prefill_dp_rank is None or pins.prefill is not None
        ):
            return None, pins
        # a rank without its worker id: only the kv mode's router can use it (it restricts
        # that phase's selection to the rank), so it travels in the nvext
    nvext = apply_header_routing_overrides(nvext, routing)
    return nvext, read_pins(nvext)


def check_pins(pins: Pins, mode: Mode, *, enforce_disagg: bool) -> None:
    """400 when the request lacks a pin its mode requires.

    Direct mode needs the decode worker; with `enforce_disagg` it also needs the prefill worker.
    The picking modes fill in what is missing themselves (and apply `enforce_disagg` when they
    pick), so a partial pin is fine there.
    """
    if mode is not Mode.DIRECT:
        return
    if pins.decode is None:
        raise OpenAIError(400, WORKER_ID_REQUIRED, param=WORKER_INSTANCE_ID)
    if enforce_disagg and pins.prefill is None:
        raise OpenAIError(400, PREFILL_ID_REQUIRED, param=PREFILL_INSTANCE_ID)
