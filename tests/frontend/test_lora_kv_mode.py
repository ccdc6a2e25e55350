"""LoRA adapters in the frontend's `--mode kv`: requests for adapter `sql` go only to the worker
serving it, a repeated `sql` prompt is cached there (and scored so through its KV events) while
the same prompt for the base model is not, and a model nobody serves is the frontend's 404."""

import openai
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.tokenization import get_tokenizer
from dynamograph.router.scheduler import RouteRequest
from dynamograph.worker.lora import LoraModule
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import client, run_frontend, served

pytestmark = pytest.mark.integration

PROMPT = "Translate each customer question into SQL over the orders and refunds tables. " * 6


def cached_blocks(fe, lora_name: str | None) -> int:
    """Prompt blocks the frontend's router scores as cached, hashed as for `lora_name`."""
    router = fe.routing.router
    tokens = get_tokenizer("qwen").encode(PROMPT, add_special_tokens=True)
    hashes = block_hashes(tokens, router.block_size, lora_name)
    probe = RouteRequest("probe", hashes, len(tokens), lora_name=lora_name, query_only=True)
    return router.schedule(probe).decode.overlap_blocks


async def test_adapter_routing_and_caching_in_kv_mode(model):
    async with (
        mock_worker(name="fe-lora-sql", lora_modules=[LoraModule("sql", "/a/sql")]) as a,
        mock_worker(name="fe-lora-none") as b,
        run_frontend(None, [a, b], mode=Mode.KV) as fe,
    ):
        assert fe.routing.router.workers()[a.config.instance_id].lora_names == {"sql"}, (
            "the router core did not register the worker's adapters: Router.add_engine must pass "
            "lora_names=config.lora_adapters to add_worker (epp/scheduler.py)"
        )
        api = client(fe)
        assert sorted(m.id for m in (await api.models.list()).data) == [model, "sql"]
        for i in range(4):
            out = await api.completions.create(model="sql", prompt=f"{i}: {PROMPT}", max_tokens=1)
            assert out.model == "sql"
        assert (await served(a))["total"] == 4 and (await served(b))["total"] == 0

        await api.completions.create(model="sql", prompt=PROMPT, max_tokens=1)
        await wait_for(lambda: cached_blocks(fe, "sql") > 0, what="the adapter's KV events")
        assert cached_blocks(fe, None) == 0  # the base model's hashes of the same tokens differ
        again = await api.completions.create(model="sql", prompt=PROMPT, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        base = await api.completions.create(model=model, prompt=PROMPT, max_tokens=1)
        assert base.usage.prompt_tokens_details.cached_tokens == 0

        with pytest.raises(openai.NotFoundError) as err:
            await api.completions.create(model="chat", prompt="x", max_tokens=1)
        assert "served: Qwen/Qwen3-0.6B, sql" in err.value.message  # the frontend's answer
        assert fe.routing.router.active.total_requests() == 0
