"""Explicit placement of a request: the workers (and DP ranks) that routing headers or nvext pin.

One rule for EPP and frontend alike (Dynamo's nvext.rs): a pinned phase bypasses selection. Apply
`headers.apply_header_routing_overrides` first when both headers and a body are at hand.
"""

from dataclasses import dataclass

from .headers import RoutingHeaders
from .nvext import NvExt


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
