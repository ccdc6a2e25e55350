"""LoRA adapters through the EPP: two real mock workers, one serving adapter `sql`. Requests for
`sql` always go to that worker; its KV events make a repeated `sql` prompt score as cached
there, while the same prompt for the base model does not; models nobody serves are a 404."""

import aiohttp
import orjson
import pytest

from dynamograph.protocol.headers import WORKER_INSTANCE_ID
from dynamograph.worker.lora import LoraModule
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, ExtProcClient, chat_body, running_epp, set_headers

pytestmark = pytest.mark.integration

PROMPT = "Write one SQL query per question about the orders table and explain each join. " * 6


@pytest.fixture
async def pool():
    async with (
        mock_worker(model=MODEL, name="lora-sql", lora_modules=[LoraModule("sql", "/a/sql")]) as a,
        mock_worker(model=MODEL, name="lora-none") as b,
        running_epp([a, b]) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        try:
            yield epp, client, a, b
        finally:
            await client.close()


def check_adapters_registered(epp, worker) -> None:
    assert epp.router.workers()[worker.config.instance_id].lora_names == {"sql"}, (
        "the router core did not register the worker's adapters: Router.add_engine must pass "
        "lora_names=config.lora_adapters to add_worker (epp/scheduler.py)"
    )


async def routed_to(client, body: bytes) -> int:
    """Send one request through the ext_proc protocol; the instance id the EPP picked."""
    stream = client.stream()
    first, _, _ = await stream.request(body)
    assert not first.HasField("immediate_response"), first.immediate_response.body[:300]
    await stream.finish_response()  # frees the booking
    return int(set_headers(first)[WORKER_INSTANCE_ID])


async def predicted_cached(epp, model: str) -> int:
    """The prompt tokens the EPP's picker scores as cached on the worker it picks."""
    route = await epp.picker.pick("/v1/chat/completions", {}, chat_body(PROMPT, model=model), None)
    route.guard.free()
    return route.predicted_cached_tokens


async def serve_adapter_prompt(epp, worker) -> None:
    """`worker` serves PROMPT for adapter `sql`; returns once the EPP scores it as cached."""
    body = {"model": "sql", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as http,
        http.post(worker.url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
    await wait_for(
        lambda: predicted_cached(epp, "sql"), "the adapter's blocks in the index", within=20
    )  # (an awaitable probe: wait_for awaits it; 0 cached tokens is falsy)


async def test_adapter_requests_always_go_to_the_worker_serving_it(pool):
    epp, client, a, _ = pool
    check_adapters_registered(epp, a)
    assert epp.pipeline.models == {MODEL: None, "sql": "sql"}
    for i in range(6):
        body = chat_body(f"question {i}: " + PROMPT, model="sql")
        assert await routed_to(client, body) == a.config.instance_id


async def test_repeated_adapter_prompt_is_cached_only_for_that_adapter(pool):
    epp, _, a, _ = pool
    check_adapters_registered(epp, a)
    assert await predicted_cached(epp, "sql") == 0
    # the worker serves it and publishes its blocks (tagged with the adapter)
    await serve_adapter_prompt(epp, a)
    # the same tokens for the base model hash differently: nothing cached anywhere
    assert await predicted_cached(epp, MODEL) == 0


async def test_the_adapters_name_in_its_events_needs_no_id_mapping(pool):
    """The worker's events name the adapter (`lora_name`, as vLLM's do): its blocks are found
    for that adapter's requests even when the EPP cannot map the engine's lora ids (a vLLM pod
    whose adapters were loaded at run time, their ids unknown to the pool's config)."""
    epp, _, a, _ = pool
    epp.router._lora_ids[a.config.instance_id] = {}  # no id → name mapping for this worker
    await serve_adapter_prompt(epp, a)


@pytest.mark.parametrize("model", ["no-such-model", "chat"])
async def test_models_nobody_serves_are_a_404(pool, model):
    _, client, _, _ = pool
    first, _, _ = await client.stream().request(chat_body("x", model=model))
    assert first.immediate_response.status.code == 404
    error = orjson.loads(first.immediate_response.body)["error"]
    assert f"`{model}`" in error["message"] and "served: Qwen/Qwen3-0.6B, sql" in error["message"]
