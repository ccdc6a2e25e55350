"""Direct routing with real mock workers and the official `openai` client: the frontend sends
each request to the worker and DP rank its headers name, as the workers themselves report."""

import aiohttp
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.worker.testing import mock_worker

from .conftest import client, frontend_metric, get_json, route, run_frontend, served

pytestmark = pytest.mark.integration


async def test_routes_to_the_named_worker_and_dp_rank(model):
    async with (
        mock_worker(data_parallel_size=2) as local,
        mock_worker() as other,
        run_frontend(local, [other]) as fe,
    ):
        api = client(fe)
        for rank in (1, 0, 1):
            out = await api.completions.create(
                model=model, prompt="hello there", max_tokens=3, extra_headers=route(local, rank)
            )
            assert out.usage.completion_tokens == 3
        seen = await served(local)
        assert seen["by_dp_rank"] == {"0": 1, "1": 2}
        assert [e["dp_rank"] for e in seen["recent"]] == [1, 0, 1]
        assert (await served(other))["total"] == 0

        # Another worker's id: that worker's engine, found through discovery.
        chat = await api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_headers=route(other),
        )
        assert chat.choices[0].message.content
        assert (await served(other))["total"] == 1
        assert (await served(local))["total"] == 3
        assert await frontend_metric(fe, "dynamograph_frontend_requests_total", outcome="ok") == 4


async def test_dynamo_alias_headers_and_body_nvext_route_too(model):
    async with mock_worker(data_parallel_size=2) as local, run_frontend(local) as fe:
        api = client(fe)
        wid = str(local.config.instance_id)
        await api.completions.create(
            model=model,
            prompt="x",
            max_tokens=1,
            extra_headers={"x-dynamo-worker-instance-id": wid, "x-dynamo-dp-rank": "1"},
        )
        await api.completions.create(
            model=model,
            prompt="x",
            max_tokens=1,
            extra_body={"nvext": {"backend_instance_id": local.config.instance_id, "dp_rank": 0}},
        )
        assert [e["dp_rank"] for e in (await served(local))["recent"]] == [1, 0]


async def test_stream_passes_through_and_final_chunk_carries_nvext(model):
    async with mock_worker(data_parallel_size=2) as local, run_frontend(local) as fe:
        api = client(fe)
        stream = await api.completions.create(
            model=model,
            prompt="count with me",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=route(local, 1),
            extra_body={"nvext": {"extra_fields": ["worker_id", "timing"]}},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert len([c for c in chunks if c.choices]) == 6 and text
        final = chunks[-1].model_extra["nvext"]
        assert final["worker_id"] == {
            "decode_worker_id": local.config.instance_id,
            "decode_dp_rank": 1,
        }
        timing = final["timing"]
        assert timing["prompt_tokens"] == chunks[-1].usage.prompt_tokens
        assert 0 <= timing["ttft_ms"] <= timing["total_time_ms"]

        # Without extra_fields the stream is relayed untouched: no nvext from the frontend.
        plain = await api.completions.create(
            model=model, prompt="count", max_tokens=3, stream=True, extra_headers=route(local)
        )
        assert all("nvext" not in (c.model_extra or {}) for c in [c async for c in plain])


async def test_non_streaming_nvext_and_engine_response_headers(model):
    async with mock_worker() as local, run_frontend(local) as fe:
        raw = await client(fe).completions.with_raw_response.create(
            model=model,
            prompt="hi",
            max_tokens=2,
            extra_headers=route(local),
            extra_body={"nvext": {"extra_fields": ["worker_id"]}},
        )
        assert raw.headers["x-dynamograph-worker-id"] == str(local.config.instance_id)
        body = raw.parse()
        assert body.model_extra["nvext"]["worker_id"]["decode_worker_id"] == (
            local.config.instance_id
        )


async def test_models_health_metrics(model):
    async with mock_worker() as local, run_frontend(local) as fe:
        models = await client(fe).models.list()
        assert [m.id for m in models.data] == [model]
        health = await get_json(fe.url + "/health")
        assert health["status"] == "ok" and health["instance_id"] == local.config.instance_id
        async with aiohttp.ClientSession() as session, session.get(fe.url + "/metrics") as r:
            text = await r.text()
        assert r.status == 200 and "dynamograph_frontend_requests_total" in text
        assert 'dynamograph_frontend_known_workers{role="aggregated"} 1.0' in text


async def test_health_is_503_until_there_is_an_engine_to_serve():
    from dynamograph.frontend.server import Frontend, FrontendConfig

    standalone = Frontend(FrontendConfig(mode=Mode.ROUND_ROBIN))  # discovers nobody
    await standalone.start()
    try:
        async with aiohttp.ClientSession() as session, session.get(standalone.url + "/health") as r:
            body = await r.json()
        assert (
            r.status == 503
            and body["reason"] == "no decode or aggregated workers are discovered yet"
        )
    finally:
        await standalone.stop()

    fe = Frontend(FrontendConfig(engine_url="http://127.0.0.1:9"))  # nothing listens there
    await fe.start()
    try:
        async with aiohttp.ClientSession() as session, session.get(fe.url + "/health") as r:
            body = await r.json()
        assert r.status == 503 and "has not answered /v1/engine" in body["reason"]
        assert (await get_json(fe.url + "/live"))["status"] == "alive"  # liveness does not wait
    finally:
        await fe.stop()


async def test_round_robin_mode_spreads_over_workers_and_ranks(model):
    async with (
        mock_worker(data_parallel_size=2) as a,
        mock_worker() as b,
        run_frontend(None, [a, b], mode=Mode.ROUND_ROBIN) as fe,
    ):
        api = client(fe)
        for _ in range(6):
            await api.completions.create(model=model, prompt="rr", max_tokens=1)
        seen_a, seen_b = await served(a), await served(b)
        assert seen_a["by_dp_rank"] == {"0": 2, "1": 2} and seen_b["total"] == 2
        # A pin still wins in a picking mode.
        await api.completions.create(model=model, prompt="rr", max_tokens=1, extra_headers=route(b))
        assert (await served(b))["total"] == 3
