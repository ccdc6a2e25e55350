"""The worker's ports locked down: admin and debug endpoints off by default or behind the
graph's admin token, KV-event and replay sockets bound to the advertised host, not every
interface. Real workers on 127.0.0.1 (and 127.0.0.2, another loopback address, to tell an
address-specific bind from a wildcard one)."""

import asyncio
import contextlib

import aiohttp
import numpy as np
import pytest

from dynamograph.protocol.engine import Role
from dynamograph.worker.handoff import PULL_PATH
from dynamograph.worker.testing import mock_worker

from .conftest import MODEL, post_json

pytestmark = pytest.mark.integration

PROMPT = np.random.default_rng(7).integers(1000, 50000, 300).astype("<u4").tolist()
ADMIN = ("/debug/requests", "/reset_prefix_cache")


async def call(url: str, path: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    method = "GET" if path == "/debug/requests" else "POST"
    body = {"remote_engine_id": "x", "remote_request_id": "y"} if path == PULL_PATH else None
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url + path, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.text()


async def test_debug_and_admin_endpoints_are_off_by_default():
    async with (
        mock_worker(model=MODEL, kv_events=False, debug_endpoints=False) as w,
        mock_worker(model=MODEL, kv_events=False, role=Role.PREFILL) as prefill,
    ):
        for path in ADMIN:
            status, text = await call(w.url, path)
            assert status == 404 and "--debug-endpoints" in text, (path, text)
        # The hand-off's pull: only prefill engines serve it; open there without a token
        # (decode engines need it).
        status, text = await call(w.url, PULL_PATH)
        assert status == 404 and "prefill engines only" in text
        status, text = await call(prefill.url, PULL_PATH)
        assert status == 404 and "no held KV" in text


async def test_an_admin_token_guards_every_admin_endpoint():
    async with mock_worker(
        model=MODEL, kv_events=False, admin_token="s3cret", role=Role.PREFILL
    ) as w:
        for path in (*ADMIN, PULL_PATH):
            for token in (None, "wrong", "s3cret-but-longer"):
                status, text = await call(w.url, path, token)
                assert status == 401 and "admin token" in text, (path, token, text)
        assert (await call(w.url, "/debug/requests", "s3cret"))[0] == 200
        assert (await call(w.url, "/reset_prefix_cache", "s3cret"))[0] == 200
        assert (await call(w.url, PULL_PATH, "s3cret"))[0] == 404  # allowed; nothing held


@pytest.mark.parametrize(("decode_token", "pulled"), [("graph-token", True), ("other", False)])
async def test_the_handoff_pulls_with_the_graphs_token(decode_token, pulled):
    """A decode engine with the graph's token pulls the prefill's KV; one without it cannot
    and recomputes the prompt (as vLLM does when a KV load fails)."""
    async with (
        mock_worker(model=MODEL, role=Role.PREFILL, admin_token="graph-token") as p,
        mock_worker(model=MODEL, role=Role.DECODE, admin_token=decode_token) as d,
    ):
        leg1 = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        params = (await post_json(p.url, "/v1/completions", leg1))["kv_transfer_params"]
        leg2 = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
        out = await post_json(d.url, "/v1/completions", leg2)
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (len(PROMPT) // 16 * 16 if pulled else 0)
        assert (len(p.engine.ranks[0].transfers) == 0) is pulled


async def connects(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def test_kv_event_sockets_bind_the_advertised_host_not_every_interface():
    """A worker listening on 0.0.0.0 with advertise host 127.0.0.1 (a pod: --host 0.0.0.0,
    $POD_IP) serves HTTP on every interface but its KV events and replay only on 127.0.0.1:
    127.0.0.2 (another address of this machine) reaches the first and not the others."""
    async with mock_worker(model=MODEL, host="0.0.0.0", advertise_host="127.0.0.1") as w:
        assert await connects("127.0.0.2", w.server.port)  # the control: 127.0.0.2 works
        events = int(w.config.kv_events.endpoint.rsplit(":", 1)[1])
        replay = int(w.config.kv_events.replay_endpoint.rsplit(":", 1)[1])
        assert w.config.kv_events.endpoint == f"tcp://127.0.0.1:{events}"
        for port in (events, replay):
            assert await connects("127.0.0.1", port)
            assert not await connects("127.0.0.2", port)
