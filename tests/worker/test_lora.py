"""A mock worker serving LoRA adapters, seen from outside: `/v1/models`, `/v1/engine`, 404 for
unknown models, KV events naming the adapter's id, prefix reuse only within one adapter, and
vLLM's `vllm:lora_requests_info`."""

import asyncio

import aiohttp
import pytest
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.protocol.hashing import block_hashes
from dynamograph.worker.lora import LoraModule
from dynamograph.worker.testing import mock_worker, worker_process
from e2e.waiting import wait_for

from .conftest import MODEL, post_json
from .test_kv_events import replay, wait_idle

pytestmark = pytest.mark.integration

ADAPTERS = [LoraModule("sql", "/adapters/sql"), LoraModule("chat", "/adapters/chat")]
PROMPT = "The quarterly report lists every region's sales, returns and margins. " * 8


@pytest.fixture
async def lora_worker():
    async with mock_worker(model=MODEL, lora_modules=ADAPTERS, max_loras=2) as w:
        yield w


async def complete(url, model, prompt=PROMPT, expect=200):
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    return await post_json(url, "/v1/completions", body, expect=expect)


async def test_models_and_engine_list_the_adapters_under_the_base_model(lora_worker):
    async with aiohttp.ClientSession() as http, http.get(lora_worker.url + "/v1/models") as r:
        models = (await r.json())["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        (MODEL, None, MODEL),
        ("sql", MODEL, "/adapters/sql"),
        ("chat", MODEL, "/adapters/chat"),
    ]
    assert lora_worker.config.lora_adapters == {1: "sql", 2: "chat"}


async def test_engine_document_names_adapters_only_when_there_are_some(lora_worker):
    async with aiohttp.ClientSession() as http:
        async with http.get(lora_worker.url + "/v1/engine") as r:
            assert (await r.json())["lora_adapters"] == {"1": "sql", "2": "chat"}
        async with mock_worker(model=MODEL) as plain, http.get(plain.url + "/v1/engine") as r:
            assert "lora_adapters" not in await r.json()  # what routers before LoRA accept


async def test_unknown_model_is_a_404_with_vllms_message(lora_worker):
    body = await complete(lora_worker.url, "nope", expect=404)
    assert body["error"]["message"] == "The model `nope` does not exist."
    assert body["error"]["code"] == 404 and body["error"]["param"] == "model"
    out = await complete(lora_worker.url, "sql")
    assert out["model"] == "sql" and out["usage"]["completion_tokens"] == 2


async def test_cached_tokens_only_for_prefixes_of_the_same_adapter(lora_worker):
    def cached(out):
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    url = lora_worker.url
    assert cached(await complete(url, "sql")) == 0
    assert cached(await complete(url, "sql")) > 0  # the same adapter reuses its blocks
    assert cached(await complete(url, MODEL)) == 0  # the base model does not
    assert cached(await complete(url, "chat")) == 0  # nor does another adapter
    assert cached(await complete(url, MODEL)) > 0


async def test_kv_events_carry_the_adapters_vllm_id(lora_worker):
    await complete(lora_worker.url, "chat")
    await complete(lora_worker.url, MODEL)
    await wait_idle(lora_worker.engine)
    ctx = zmq.asyncio.Context()
    try:
        batches = await replay(ctx, lora_worker.config.kv_events.replay_endpoint, 0)
    finally:
        ctx.term()
    stored = [e for _, events, _ in batches for e in events if e[0] == "BlockStored"]
    by_lora = {e[5]: e for e in stored}
    assert set(by_lora) == {2, None}  # "chat" is the second adapter loaded: id 2
    tokens, size = by_lora[2][3], by_lora[2][4]
    # the same tokens, stored once per adapter: a router rebuilds distinct hashes for each
    assert tokens == by_lora[None][3]
    assert block_hashes(tokens, size, "chat") != block_hashes(tokens, size)


async def lora_info(url) -> dict[str, str] | None:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    samples = [
        s
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:lora_requests_info"
        for s in family.samples
    ]
    if not samples:
        return None
    (sample,) = samples
    assert sample.value > 1.7e9  # vLLM's value: when the gauge was updated
    return sample.labels


async def test_lora_requests_info_names_running_adapters_and_max_lora():
    async with mock_worker(model=MODEL, lora_modules=ADAPTERS, max_loras=2, speedup=1.0) as w:
        assert await lora_info(w.url) == {
            "max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""
        }  # fmt: skip
        body = {"model": "sql", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
        running = asyncio.create_task(post_json(w.url, "/v1/completions", body))
        try:

            async def sql_running() -> bool:
                return (await lora_info(w.url))["running_lora_adapters"] == "sql"

            await wait_for(sql_running, "adapter sql to show as running", within=10)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    async with mock_worker(model=MODEL) as plain:  # no adapters: no LoRA gauge, as vLLM
        assert await lora_info(plain.url) is None


async def test_cli_serves_adapters_from_both_flag_forms():
    async with worker_process(
        "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}'
    ) as w:  # fmt: skip
        assert w.config.lora_adapters == {1: "sql", 2: "chat"}
        assert (await complete(w.url, "chat"))["model"] == "chat"


async def test_handoff_of_an_adapter_request_reuses_the_prefills_kv():
    from dynamograph.protocol.engine import Role

    async with (
        mock_worker(model=MODEL, role=Role.PREFILL, lora_modules=ADAPTERS) as prefill,
        mock_worker(model=MODEL, role=Role.DECODE, lora_modules=ADAPTERS) as decode,
    ):

        async def handoff(prefill_model, decode_model) -> int:
            """Prefill leg, then decode leg; the prompt tokens the decode did not recompute."""
            first = {"model": prefill_model, "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
            params = (await post_json(prefill.url, "/v1/completions", first))["kv_transfer_params"]
            second = {"model": decode_model, "prompt": PROMPT, "max_tokens": 2,
                      "kv_transfer_params": params}  # fmt: skip
            out = await post_json(decode.url, "/v1/completions", second)
            return out["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await handoff("sql", "sql") > 0  # the decode's hashes under `sql` match
        assert await handoff("sql", "chat") == 0  # another adapter's KV is recomputed
