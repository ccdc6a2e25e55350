"""Shared by the bench tests that start the field's EPPs behind our Envoy."""

import pytest

from dynamograph.bench.route_foreign_epp import unavailable
from dynamograph.local.envoy import EnvoyNotFound, find_envoy


def skip_unless_foreign_epp_runs(counterpart: str, *, precise: bool = False) -> None:
    """Skip, saying what is missing, unless `counterpart`'s policy can run here: its binary and
    the control plane built (`make counterparts`, `make control-plane`) and Envoy installed."""
    reason = unavailable(counterpart, precise=precise)
    if reason:
        pytest.skip(reason)
    try:
        find_envoy()
    except EnvoyNotFound as exc:
        pytest.skip(str(exc))
