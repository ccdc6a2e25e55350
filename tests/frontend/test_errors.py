"""Every error path of the frontend, with its status and a message a person can act on."""

import contextlib

import aiohttp
import openai
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.protocol.engine import Role
from dynamograph.worker.testing import RunningWorker, mock_worker
from e2e.waiting import wait_for

from .conftest import client, engine_gauges, frontend_metric, route, run_frontend, served

pytestmark = pytest.mark.integration

PROMPT = "Errors should say what to do about them. " * 6


async def expect_error(call, status: int, *phrases: str) -> str:
    with pytest.raises(openai.APIStatusError) as info:
        await call
    assert info.value.status_code == status, info.value.body
    message = info.value.body["message"]
    for phrase in phrases:
        assert phrase in message, message
    return message


async def post_raw(url: str, data: bytes, **headers: str) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as r,
    ):
        return r.status, await r.json()


async def test_request_errors(model):
    async with (
        mock_worker() as local,
        mock_worker(role=Role.PREFILL) as prefill,
        run_frontend(local, [prefill], max_body_bytes=4096) as fe,
    ):
        api = client(fe)
        completion = dict(model=model, prompt="hi", max_tokens=1)
        # Direct mode without the picker's header.
        await expect_error(
            api.completions.create(**completion),
            400,
            "Worker ID required",
            "expected x-worker-instance-id set by the endpoint picker",
        )
        # Ids that no discovered worker has: 503 naming the id and the leg.
        await expect_error(
            api.completions.create(**completion, extra_headers={"x-worker-instance-id": "12345"}),
            503,
            "unknown decode worker instance id 12345",
        )
        await expect_error(
            api.completions.create(
                **completion, extra_headers={**route(local), "x-prefill-instance-id": "777"}
            ),
            503,
            "unknown prefill worker instance id 777",
        )
        # A DP rank the worker does not have.
        await expect_error(
            api.completions.create(**completion, extra_headers=route(local, 4)),
            400,
            "data-parallel rank 4 is out of range",
            "data_parallel_size 1",
        )
        # Body cap.
        await expect_error(
            api.completions.create(model=model, prompt="x" * 5000, extra_headers=route(local)),
            413,
            "limit of 4096 bytes",
            "--max-body-bytes",
        )
        # Bad nvext, client-supplied kv_transfer_params.
        await expect_error(
            api.completions.create(
                **completion, extra_headers=route(local), extra_body={"nvext": {"dp_rank": "x"}}
            ),
            400,
            "nvext.dp_rank: ",
        )
        await expect_error(
            api.completions.create(
                **completion,
                extra_headers=route(local),
                extra_body={"kv_transfer_params": {"remote_host": "10.0.0.1"}},
            ),
            400,
            "kv_transfer_params",
            "may not come from the client",
        )
        # On the prefill leg it is named as the prefill worker's refusal.
        await expect_error(
            api.completions.create(
                model="no-such-model", prompt="hi", extra_headers=route(local, prefill=prefill)
            ),
            404,
            "prefill worker",
            "refused the request",
        )
        # Not JSON at all (the openai client cannot send that).
        status, body = await post_raw(fe.url + "/v1/completions", b"{not json", **route(local))
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = await post_raw(fe.url + "/v1/completions", b"[1]", **route(local))
        assert status == 400 and "must be a JSON object" in body["error"]["message"]
        assert (await served(local))["total"] == 0  # nothing above was served
        counted = {
            outcome: await frontend_metric(
                fe, "dynamograph_frontend_requests_total", outcome=outcome
            )
            for outcome in ("client_error", "unavailable", "ok")
        }
        assert counted == {"client_error": 8, "unavailable": 2, "ok": 0}


async def test_the_engines_refusal_passes_through_unchanged(model):
    async with mock_worker() as local, run_frontend(local) as fe:
        await expect_error(
            client(fe).completions.create(
                model="no-such-model", prompt="hi", extra_headers=route(local)
            ),
            404,
            "no-such-model",
        )


async def test_enforce_disagg_names_the_missing_header(model):
    async with mock_worker() as local, run_frontend(local, enforce_disagg=True) as fe:
        await expect_error(
            client(fe).completions.create(
                model=model, prompt="hi", max_tokens=1, extra_headers=route(local)
            ),
            400,
            "--enforce-disagg",
            "x-prefill-instance-id",
        )


async def test_picking_modes_without_workers_are_503(model):
    async with (
        mock_worker() as agg,
        run_frontend(None, [agg], mode=Mode.ROUND_ROBIN, enforce_disagg=True) as fe,
    ):
        await expect_error(
            client(fe).completions.create(model=model, prompt="hi", max_tokens=1),
            503,
            "no prefill workers are discovered",
        )


async def test_engine_silent_past_the_timeout_is_504_and_freed(model):
    async with (
        mock_worker(speedup=0.05) as slow,  # ~130 ms per decode step
        run_frontend(slow, request_timeout=0.4) as fe,
    ):
        await expect_error(
            client(fe).completions.create(
                model=model,
                prompt="slow",
                max_tokens=200,
                extra_headers=route(slow),
                extra_body={"ignore_eos": True},
            ),
            504,
            "sent nothing for 0.4 s",
            "--request-timeout",
        )
        # The frontend hung up, so the engine aborted the request.
        await wait_for(lambda: _idle(slow), what="the slow worker to drop the timed-out request")
        assert await frontend_metric(fe, "dynamograph_frontend_requests_total", outcome="timeout")


async def _idle(worker) -> bool:
    gauges = await engine_gauges(worker)
    return gauges["running"] == 0 and gauges["waiting"] == 0 and gauges["kv_usage"] == 0


async def test_prefill_failures_without_and_with_fallback(model):
    async with contextlib.AsyncExitStack() as stack:
        decode = await stack.enter_async_context(mock_worker(role=Role.DECODE))
        aggregated = await stack.enter_async_context(mock_worker())  # no KV connector role
        prefill_cm = mock_worker(role=Role.PREFILL)
        prefill = await prefill_cm.__aenter__()
        strict = await stack.enter_async_context(run_frontend(decode, [prefill, aggregated]))
        lenient = await stack.enter_async_context(
            run_frontend(decode, [prefill, aggregated], disagg_fallback=True)
        )
        request = dict(model=model, prompt=PROMPT, max_tokens=3)

        # A "prefill" worker that answers without kv_transfer_params: 502, or served aggregated.
        await expect_error(
            client(strict).completions.create(
                **request, extra_headers=route(decode, prefill=aggregated)
            ),
            502,
            "prefill worker",
            "carries no kv_transfer_params",
        )
        out = await client(lenient).completions.create(
            **request,
            extra_headers=route(decode, prefill=aggregated),
            extra_body={"nvext": {"extra_fields": ["worker_id"]}},
        )
        assert out.usage.completion_tokens == 3
        assert out.model_extra["nvext"]["worker_id"] == {
            "decode_worker_id": decode.config.instance_id
        }
        assert (await served(decode))["recent"][-1]["kv_transfer"] is False
        assert await frontend_metric(lenient, "dynamograph_frontend_disagg_fallbacks_total") == 1

        # The prefill worker goes away: unreachable → 502 naming it (then it is dropped: 503).
        await prefill_cm.__aexit__(None, None, None)
        await expect_error(
            client(strict).completions.create(
                **request, extra_headers=route(decode, prefill=prefill)
            ),
            502,
            f"prefill worker {prefill.config.name} ({prefill.config.instance_id})",
            "is unreachable",
        )
        await expect_error(
            client(strict).completions.create(
                **request, extra_headers=route(decode, prefill=prefill)
            ),
            503,
            f"unknown prefill worker instance id {prefill.config.instance_id}",
        )
        out = await client(lenient).completions.create(
            **request, extra_headers=route(decode, prefill=prefill)
        )
        assert out.usage.completion_tokens == 3
        assert (
            await frontend_metric(
                strict, "dynamograph_frontend_upstream_errors_total", leg="prefill"
            )
            == 2
        )


async def test_decode_engine_unreachable_is_502(model):
    async with contextlib.AsyncExitStack() as stack:
        local = await stack.enter_async_context(mock_worker())
        other_cm = mock_worker()
        other = await other_cm.__aenter__()
        fe = await stack.enter_async_context(run_frontend(local, [other]))
        await other_cm.__aexit__(None, None, None)
        await expect_error(
            client(fe).completions.create(
                model=model, prompt="hi", max_tokens=1, extra_headers=route(other)
            ),
            502,
            f"decode worker {other.config.name}",
            "is unreachable",
        )


@contextlib.asynccontextmanager
async def engine_that_dies_mid_stream():
    """An engine that streams two events, then drops the connection (a crashed engine)."""
    from aiohttp import web

    from dynamograph.protocol.engine import EngineConfig
    from dynamograph.protocol.identity import instance_id

    config = EngineConfig(
        model="m", served_model_name="m", context_length=1024, kv_cache_block_size=16,
        total_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256,
        instance_id=instance_id("dies-mid-stream"), name="dies-mid-stream", tokenizer="qwen",
    )  # fmt: skip

    async def engine(request):
        return web.Response(body=config.model_dump_json(), content_type="application/json")

    async def generate(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in ("a", "b"):
            await response.write(b'data: {"choices": [{"text": "%s"}]}\n\n' % token.encode())
        request.transport.abort()
        return response

    app = web.Application()
    app.router.add_get("/v1/engine", engine)
    app.router.add_post("/v1/completions", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", config
    finally:
        await runner.cleanup()


async def test_engine_failing_mid_stream_ends_the_stream_with_an_error_event():
    async with (
        engine_that_dies_mid_stream() as (url, config),
        mock_worker() as local,
    ):
        dying = RunningWorker(url=url, config=config)
        async with run_frontend(local, [dying]) as fe:
            body = b'{"model": "m", "prompt": "hi", "stream": true}'
            headers = {"x-worker-instance-id": str(config.instance_id)}
            async with (
                aiohttp.ClientSession() as session,
                session.post(fe.url + "/v1/completions", data=body, headers=headers) as r,
            ):
                assert r.status == 200  # the stream had started
                text = (await r.read()).decode()
            events = [e for e in text.split("\n\n") if e]
            assert events[:2] == [
                'data: {"choices": [{"text": "a"}]}',
                'data: {"choices": [{"text": "b"}]}',
            ]
            error = events[2]
            assert '"code":502' in error and "broke the connection" in error
            assert "dies-mid-stream" in error and len(events) == 3
            assert (
                await frontend_metric(
                    fe,
                    "dynamograph_frontend_upstream_errors_total",
                    leg="decode",
                    kind="disconnect",
                )
                == 1
            )


async def test_body_cap_holds_for_chunked_uploads_without_content_length(model):
    async with mock_worker() as local, run_frontend(local, max_body_bytes=4096) as fe:

        async def body():
            yield b'{"model": "%s", "prompt": "' % model.encode()
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        async with (
            aiohttp.ClientSession() as session,
            session.post(fe.url + "/v1/completions", data=body(), headers=route(local)) as r,
        ):
            assert r.request_info.headers.get("Transfer-Encoding") == "chunked"
            error = (await r.json())["error"]
        assert r.status == 413 and "limit of 4096 bytes" in error["message"]
        assert (await served(local))["total"] == 0


async def test_unknown_path_and_wrong_method_answer_in_openai_shape(model):
    async with mock_worker() as local, run_frontend(local) as fe:
        async with aiohttp.ClientSession() as session:
            async with session.get(fe.url + "/v1/embeddings") as r:
                error = (await r.json())["error"]
            assert r.status == 404 and error["message"] == "no such path: /v1/embeddings"
            async with session.get(fe.url + "/v1/completions") as r:
                error = (await r.json())["error"]
            assert r.status == 405 and "GET is not allowed on /v1/completions" in error["message"]
            async with session.head(fe.url + "/health") as r:  # HEAD answers like GET, no body
                assert r.status == 200 and await r.read() == b""
        assert (await served(local))["total"] == 0
