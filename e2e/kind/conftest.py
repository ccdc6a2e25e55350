"""Fixtures of the kind suite: the cluster (created once per session), the gateways' URLs.

The suite skips, naming what is missing, unless docker (with a reachable daemon), kind,
kubectl and helm are all present, and it runs only on request (`DYNAMOGRAPH_E2E_KIND=1`, which
`make e2e-kind` sets), because it creates a cluster and builds an image.
"""

import contextlib
import os
import socket
import subprocess
import time

import pytest

from . import kindctl


@pytest.fixture(scope="module", autouse=True)
def module_stops_its_processes():
    """No process check here (tests/process_guard.py): the session's kind cluster outlives
    every module."""
    yield


OPT_IN = "DYNAMOGRAPH_E2E_KIND"


def skip_reason(env=os.environ) -> str | None:
    missing = kindctl.missing_requirements()
    if missing:
        return (
            "kind e2e needs: " + "; ".join(missing) + " (see docs/running.md, 'End-to-end tests')"
        )
    if env.get(OPT_IN) != "1":
        return (
            f"kind e2e creates a cluster and builds an image: run `make e2e-kind` (sets {OPT_IN}=1)"
        )
    return None


@pytest.fixture(scope="session")
def kind_cluster():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    settings = kindctl.Settings.from_env()
    kindctl.up(settings)
    try:
        yield settings
    finally:
        if not settings.keep:
            kindctl.down(settings)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gateway_url(kind_cluster):
    """kgateway's Gateway, through `kubectl port-forward` (test_kind.py's scenarios)."""
    if kindctl.KGATEWAY.name not in kind_cluster.gateways:
        pytest.skip(f"kgateway is not selected (E2E_GATEWAYS={','.join(kind_cluster.gateways)})")
    with port_forwarded(kind_cluster, kindctl.KGATEWAY) as url:
        yield url


@contextlib.contextmanager
def port_forwarded(s: kindctl.Settings, profile: kindctl.GatewayProfile):
    """`kubectl port-forward` to the Service of a gateway's proxies (port 80, the listener's),
    so the host reaches it however Docker networks it (on Linux its load-balancer address
    would do; not on macOS)."""
    port = _free_port()
    namespace, service = kindctl.gateway_service(s, profile)
    argv = kindctl.resolve(kindctl.port_forward(s, namespace, service, port, 80))
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"port-forward to the gateway failed: {process.stderr.read()}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
