"""Fixtures of the cluster-in-a-box suite.

`api_server`: the API emulator (see `emulator.py`) on 127.0.0.1 and a KubeApi client for it, for
tests of the infrastructure itself. The full cluster (operator, kubelet, Envoy) is built per
test module by `e2e.local.cluster.local_cluster`.
"""

import kmock
import pytest
import pytest_asyncio

from .emulator import make_emulator
from .kubeapi import KubeApi

ENVOY_MISSING = None
try:
    from dynamograph.local.envoy import EnvoyNotFound, find_envoy

    try:
        find_envoy()
    except EnvoyNotFound as exc:
        ENVOY_MISSING = str(exc)
except ImportError as exc:  # pragma: no cover - the local stack is part of this repo
    ENVOY_MISSING = f"dynamograph.local.envoy is not importable: {exc}"


def requires_loopback_range() -> None:
    """Pods live on 127.a.b.N: Linux routes all of 127/8 to lo; macOS only 127.0.0.1."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.200.1.2", 0))
        except OSError:
            pytest.skip("this OS does not route 127.0.0.0/8 to loopback (needed for pod IPs)")


@pytest_asyncio.fixture
async def api_server():
    requires_loopback_range()
    async with make_emulator() as emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        async with KubeApi(url) as api:
            yield url, api, emulator
