"""Routing headers set by the endpoint picker and read by the frontend.

`apply_header_routing_overrides` follows Dynamo's nvext.rs exactly: a header that does not parse
is ignored, the prefill DP rank 4294967295 (u32::MAX) means unset, no routing header leaves the
nvext untouched, and headers win over values in the body. Dynamo's newer `x-dynamo-*` aliases are
accepted; when both spellings are present the plain name wins if it parses.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from multidict import CIMultiDict, CIMultiDictProxy

from .nvext import NvExt

WORKER_INSTANCE_ID = "x-worker-instance-id"
PREFILL_INSTANCE_ID = "x-prefill-instance-id"
DP_RANK = "x-dp-rank"
PREFILL_DP_RANK = "x-prefill-dp-rank"
ROUTING_HEADERS = (WORKER_INSTANCE_ID, PREFILL_INSTANCE_ID, DP_RANK, PREFILL_DP_RANK)
ALIASES = {name: "x-dynamo-" + name.removeprefix("x-") for name in ROUTING_HEADERS}
ALL_ROUTING_HEADERS = ROUTING_HEADERS + tuple(ALIASES.values())

# GAIE endpoint-picker protocol.
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
DESTINATION_SUBSET = "x-gateway-destination-endpoint-subset"
DESTINATION_SERVED = "x-gateway-destination-endpoint-served"
GATEWAY_PREFIX = "x-gateway-"
# GAIE: the client names the request's InferenceObjective (its metadata.name) with this header;
# the one `x-gateway-*` header a client sets
INFERENCE_OBJECTIVE = "x-gateway-inference-objective"

# vLLM's per-request data-parallel rank selector.
VLLM_DP_RANK = "X-data-parallel-rank"

UNSET_DP_RANK = (1 << 32) - 1
_LIMITS = {
    WORKER_INSTANCE_ID: (1 << 64) - 1,
    PREFILL_INSTANCE_ID: (1 << 64) - 1,
    DP_RANK: (1 << 32) - 1,
    PREFILL_DP_RANK: (1 << 32) - 1,
}


class RoutingHeaderError(ValueError):
    """A routing header whose value is not an unsigned decimal in range (strict parsing only)."""


@dataclass(frozen=True, slots=True)
class RoutingHeaders:
    worker_id: int | None = None
    prefill_worker_id: int | None = None
    dp_rank: int | None = None
    prefill_dp_rank: int | None = None

    def is_empty(self) -> bool:
        return (
            self.worker_id is None
            and self.prefill_worker_id is None
            and self.dp_rank is None
            and self.prefill_dp_rank is None
        )


def _parse_unsigned(raw: str, limit: int) -> int | None:
    # Rust's str::parse::<u64>() accepts an optional leading '+' and ASCII digits, nothing else.
    digits = raw[1:] if raw.startswith("+") else raw
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    value = int(digits)
    return value if value <= limit else None


def _case_insensitive(headers: Mapping[str, str]) -> Mapping[str, str]:
    # aiohttp's multidicts already match any capitalisation; plain mappings (tests, gRPC
    # metadata) are lowered once.
    if isinstance(headers, CIMultiDict | CIMultiDictProxy):
        return headers
    return {key.lower(): value for key, value in headers.items()}


def parse_routing_headers(headers: Mapping[str, str], *, strict: bool = False) -> RoutingHeaders:
    """Read the four routing headers (or their aliases) from a header mapping.

    Lenient (the seed's semantics): a value that does not parse is ignored. Strict: it raises
    RoutingHeaderError naming the header and the value.
    """
    headers = _case_insensitive(headers)
    values: dict[str, int | None] = {}
    for name in ROUTING_HEADERS:
        values[name] = None
        for spelling in (name, ALIASES[name]):
            raw = headers.get(spelling)
            if raw is None:
                continue
            parsed = _parse_unsigned(raw.strip(), _LIMITS[name])
            if parsed is None:
                if strict:
                    raise RoutingHeaderError(
                        f"header {spelling}: {raw!r:.40} is not an unsigned decimal integer "
                        f"in 0..{_LIMITS[name]}"
                    )
                continue
            values[name] = parsed
            break
    prefill_dp_rank = values[PREFILL_DP_RANK]
    if prefill_dp_rank == UNSET_DP_RANK:
        prefill_dp_rank = None
    return RoutingHeaders(
        worker_id=values[WORKER_INSTANCE_ID],
        prefill_worker_id=values[PREFILL_INSTANCE_ID],
        dp_rank=values[DP_RANK],
        prefill_dp_rank=prefill_dp_rank,
    )


def apply_header_routing_overrides(
    nvext: NvExt | None, headers: Mapping[str, str] | RoutingHeaders
) -> NvExt | None:
    """Merge routing headers into nvext, headers winning; no headers → nvext unchanged."""
    routing = headers if isinstance(headers, RoutingHeaders) else parse_routing_headers(headers)
    if routing.is_empty():
        return nvext
    updates: dict[str, int] = {}
    if routing.worker_id is not None:
        updates["backend_instance_id"] = routing.worker_id
        updates["decode_worker_id"] = routing.worker_id
    if routing.prefill_worker_id is not None:
        updates["prefill_worker_id"] = routing.prefill_worker_id
    if routing.dp_rank is not None:
        updates["dp_rank"] = routing.dp_rank
    if routing.prefill_dp_rank is not None:
        updates["prefill_dp_rank"] = routing.prefill_dp_rank
    return (nvext or NvExt()).model_copy(update=updates)


def routing_header_values(
    worker_id: int,
    dp_rank: int | None = None,
    prefill_worker_id: int | None = None,
    prefill_dp_rank: int | None = None,
) -> dict[str, str]:
    """The headers the endpoint picker sets for a decision (canonical names, decimal values)."""
    out = {WORKER_INSTANCE_ID: str(worker_id)}
    if dp_rank is not None:
        out[DP_RANK] = str(dp_rank)
    if prefill_worker_id is not None:
        out[PREFILL_INSTANCE_ID] = str(prefill_worker_id)
        if prefill_dp_rank is not None:
            out[PREFILL_DP_RANK] = str(prefill_dp_rank)
    return out


def is_spoofable(name: str) -> bool:
    """Headers a client must never set itself: routing headers and every `x-gateway-*` header
    but the InferenceObjective's name, which GAIE has the client set."""
    lowered = name.lower()
    return lowered in ALL_ROUTING_HEADERS or (
        lowered.startswith(GATEWAY_PREFIX) and lowered != INFERENCE_OBJECTIVE
    )
