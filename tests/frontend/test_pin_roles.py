"""A pin naming a worker of the wrong role is the request's mistake: 400 with what to change,
through the HTTP surface (issue 21: an aggregated graph with a prefill pin answered 502 after
the engine refused the hand-off). The EPP runs the same pipeline (tests/router/test_one_pipeline.py)."""

from typing import Any

import aiohttp
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.protocol.engine import Role
from dynamograph.worker.testing import mock_worker

from .conftest import run_frontend, served

pytestmark = pytest.mark.integration


async def post(fe, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(fe.url + "/v1/completions", json=body) as r,
    ):
        return r.status, await r.json()


async def test_a_prefill_pin_in_an_aggregated_pool_is_a_400_that_says_what_to_change(model):
    async with mock_worker() as worker, run_frontend(None, [worker], mode=Mode.KV) as fe:
        pin = {"prefill_worker_id": worker.config.instance_id}
        body = {"model": model, "prompt": "Hello world", "max_tokens": 1, "nvext": pin}
        status, out = await post(fe, body)
        assert status == 400, out
        message = out["error"]["message"]
        assert "aggregated worker" in message and "drop the prefill pin" in message, message
        assert (await served(worker))["total"] == 0
        assert fe.routing.router.active.total_requests() == 0
        # the same request without the pin is served
        status, out = await post(fe, {**body, "nvext": {}})
        assert status == 200, out


async def test_a_decode_pin_naming_a_prefill_worker_is_a_400(model):
    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(None, [prefill, decode], mode=Mode.KV) as fe,
    ):
        pin = {"decode_worker_id": prefill.config.instance_id}
        body = {"model": model, "prompt": "Hello world", "max_tokens": 1, "nvext": pin}
        status, out = await post(fe, body)
        assert status == 400, out
        assert "prefill worker, not an aggregated or decode worker" in out["error"]["message"]
        assert (await served(prefill))["total"] == 0 and (await served(decode))["total"] == 0
