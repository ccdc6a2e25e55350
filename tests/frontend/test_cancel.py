"""A client that goes away frees the engines: the decode leg is cancelled (a prefill leg runs on
and its decode leg is still sent, to pull and free its KV, as Dynamo does), and the workers' own
gauges (running/waiting requests, KV usage) return to their idle baseline."""

import asyncio

import aiohttp
import orjson
import pytest

from dynamograph.protocol.engine import Role
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import client, engine_gauges, frontend_metric, route, run_frontend, served

pytestmark = pytest.mark.integration

PROMPT = "Cancel me politely, and free my blocks. " * 12


async def idle(*workers) -> bool:
    for worker in workers:
        gauges = await engine_gauges(worker)
        if gauges["running"] or gauges["waiting"] or gauges["kv_usage"]:
            return False
    return True


def _cut_short(entry: dict) -> bool:
    """The worker's log entry of a request that did not run to its end."""
    return (
        entry.get("finish_reason") in (None, "cancelled")
        and entry.get("completion_tokens", 0) < 5000
    )


async def busy(worker) -> bool:
    gauges = await engine_gauges(worker)
    return gauges["running"] > 0 and gauges["kv_usage"] > 0


async def test_streaming_cancel_frees_both_legs(model):
    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE, speedup=1.0) as decode,  # real-time decode: ~6 ms a token
        run_frontend(decode, [prefill]) as fe,
    ):
        assert await idle(prefill, decode)
        stream = await client(fe).completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=5000,
            stream=True,
            extra_headers=route(decode, prefill=prefill),
            extra_body={"ignore_eos": True},
        )
        received = 0
        async for chunk in stream:
            received += bool(chunk.choices)
            if received == 3:
                break
        assert await busy(decode)  # mid-generation, holding the pulled prompt KV
        await stream.close()  # the client goes away

        await wait_for(lambda: idle(prefill, decode), what="both workers to return to idle")
        (d,) = (await served(decode))["recent"]
        assert d["kv_transfer"] and _cut_short(d)
        await wait_for(
            lambda: _metric_is(fe, "dynamograph_frontend_requests_total", 1, outcome="cancelled"),
            what="the frontend to count the cancelled request",
        )
        assert await frontend_metric(fe, "dynamograph_frontend_inflight_requests") == 0


async def post_completion(url: str, body: bytes, headers: dict) -> None:
    """A non-streaming client; the tests cancel its task to hang up mid-request."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", data=body, headers=headers) as r,
    ):
        await r.read()


async def _metric_is(fe, name, value, **labels) -> bool:
    return await frontend_metric(fe, name, **labels) == value


async def test_cancel_during_the_prefill_leg_still_sends_the_decode_leg(model):
    async with (
        mock_worker(role=Role.PREFILL, speedup=0.02) as prefill,  # a slow prefill (~seconds)
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(decode, [prefill]) as fe,
    ):
        body = orjson.dumps({"model": model, "prompt": PROMPT * 4, "max_tokens": 5})
        headers = {"Content-Type": "application/json", **route(decode, prefill=prefill)}

        task = asyncio.create_task(post_completion(fe.url, body, headers))
        await wait_for(lambda: busy(prefill), what="the prefill leg to start")
        task.cancel()  # the client hangs up while the prefill worker computes
        with pytest.raises(asyncio.CancelledError):
            await task

        # the prefill runs to its end, the decode leg pulls its KV: both workers end idle
        async def decoded() -> bool:
            return (await served(decode))["total"] == 1

        await wait_for(decoded, what="the decode leg to be sent")
        await wait_for(lambda: idle(prefill, decode), what="both workers to free the request")
        (p,) = (await served(prefill))["recent"]
        assert not _cut_short(p)
        (d,) = (await served(decode))["recent"]
        assert d["kv_transfer"] and d["completion_tokens"] == 1


async def test_non_streaming_cancel_frees_the_aggregated_worker(model):
    async with mock_worker(speedup=1.0) as local, run_frontend(local) as fe:
        api = client(fe)
        task = asyncio.create_task(
            api.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=5000,
                extra_headers=route(local),
                extra_body={"ignore_eos": True},
            )
        )
        await _hang_up_mid_generation(task, local)


async def test_client_gone_right_after_sending_frees_the_worker(model):
    """No waiter, no grace period: the connection closing is the signal, so a client that
    hangs up as soon as generation starts is noticed at once and the engine aborts."""
    async with mock_worker(speedup=1.0) as local, run_frontend(local) as fe:
        body = orjson.dumps(
            {"model": model, "prompt": PROMPT, "max_tokens": 5000, "ignore_eos": True}
        )
        headers = {"Content-Type": "application/json", **route(local)}

        task = asyncio.create_task(post_completion(fe.url, body, headers))
        await _hang_up_mid_generation(task, local)
        await wait_for(
            lambda: _metric_is(fe, "dynamograph_frontend_requests_total", 1, outcome="cancelled"),
            what="the frontend to count the cancelled request",
        )


async def test_client_gone_mid_body_never_reaches_the_engine(model):
    """A client that sends its head and part of its body, then hangs up: counted as
    cancelled, nothing sent to the engine, nothing left in flight."""
    async with mock_worker() as local, run_frontend(local) as fe:
        host, port = fe.url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        worker_id = local.config.instance_id
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'x-worker-instance-id: %d\r\nContent-Length: 1000\r\n\r\n{"model": ' % worker_id
        )
        await writer.drain()
        await wait_for(
            lambda: _metric_is(fe, "dynamograph_frontend_inflight_requests", 1),
            what="the frontend to start the request",
        )
        writer.close()
        await writer.wait_closed()
        await wait_for(
            lambda: _metric_is(fe, "dynamograph_frontend_requests_total", 1, outcome="cancelled"),
            what="the frontend to count the cancelled request",
        )
        assert await frontend_metric(fe, "dynamograph_frontend_inflight_requests") == 0
        assert (await served(local))["total"] == 0


async def _hang_up_mid_generation(task: asyncio.Task, worker) -> None:
    """Cancel the client's request once the worker generates; the worker must abort it."""
    await wait_for(lambda: busy(worker), what="generation to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: idle(worker), what="the worker to abort the request")
    assert _cut_short((await served(worker))["recent"][0])
