"""The prefill → decode hand-off through the frontend, checked on both workers: the prefill
worker ran a one-token, non-streamed leg with do_remote_decode; the decode worker consumed its
kv_transfer_params and reports the prompt's KV as cached (pulled, not recomputed)."""

import openai
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.protocol.engine import Role
from dynamograph.worker.testing import mock_worker

from .conftest import client, frontend_metric, route, run_frontend, served

pytestmark = pytest.mark.integration

PROMPT = "Disaggregated serving splits prefill from decode. " * 8  # several full KV blocks


@pytest.mark.parametrize("stream", [False, True])
async def test_handoff_prefill_then_decode(model, stream):
    async with (
        mock_worker(role=Role.PREFILL, data_parallel_size=2) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(decode, [prefill]) as fe,
    ):
        request = dict(
            model=model,
            prompt=PROMPT,
            max_tokens=7,
            extra_headers=route(decode, prefill=prefill, prefill_rank=1),
            extra_body={"nvext": {"extra_fields": ["worker_id", "timing"]}, "ignore_eos": True},
        )
        api = client(fe)
        if stream:
            chunks = [
                c
                async for c in await api.completions.create(
                    **request, stream=True, stream_options={"include_usage": True}
                )
            ]
            tokens = len([c for c in chunks if c.choices])
            usage, nvext = chunks[-1].usage, chunks[-1].model_extra["nvext"]
        else:
            out = await api.completions.create(**request)
            tokens, usage, nvext = out.usage.completion_tokens, out.usage, out.model_extra["nvext"]

        # The client got its own limits back: 7 tokens, streamed if it asked.
        assert tokens == 7
        (p,) = (await served(prefill))["recent"]
        assert p["kv_transfer"] and p["dp_rank"] == 1
        assert p["completion_tokens"] == 1 and p["finish_reason"] == "length"  # max_tokens=1
        (d,) = (await served(decode))["recent"]
        assert d["kv_transfer"] and d["completion_tokens"] == 7
        block = decode.config.kv_cache_block_size
        full_blocks = (d["prompt_tokens"] // block) * block
        assert d["cached_tokens"] == full_blocks > 0  # the prompt's KV came from the prefill
        assert usage.prompt_tokens_details.cached_tokens == full_blocks
        assert nvext["worker_id"] == {
            "prefill_worker_id": prefill.config.instance_id,
            "prefill_dp_rank": 1,
            "decode_worker_id": decode.config.instance_id,
        }
        assert nvext["timing"]["cached_tokens"] == full_blocks
        assert 0 < nvext["timing"]["prefill_time_ms"] <= nvext["timing"]["total_time_ms"]
        assert await frontend_metric(fe, "dynamograph_frontend_requests_total", disagg="true") == 1


async def test_chat_handoff_keeps_max_completion_tokens(model):
    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(decode, [prefill]) as fe,
    ):
        out = await client(fe).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_completion_tokens=5,
            extra_headers=route(decode, prefill=prefill),
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == 5
        assert (await served(prefill))["recent"][0]["completion_tokens"] == 1
        assert out.usage.prompt_tokens_details.cached_tokens > 0


async def test_round_robin_mode_disaggregates_when_prefill_workers_exist(model):
    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(None, [prefill, decode], mode=Mode.ROUND_ROBIN) as fe,
    ):
        out = await client(fe).completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert out.usage.prompt_tokens_details.cached_tokens > 0
        assert (await served(prefill))["total"] == 1 and (await served(decode))["total"] == 1


async def test_a_request_routed_without_a_prefill_worker_is_served_aggregated(model):
    """The endpoint picker routes aggregated when it has no ready prefill worker (it drops one
    whose scrapes fail) while this sidecar may still discover it: no x-prefill-instance-id
    means aggregated (docs/frontend.md), as in the picking modes. Only `--enforce-disagg`,
    for decode engines that must not prefill, refuses it."""
    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(decode, [prefill, decode]) as fe,
    ):
        out = await client(fe).completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=3,
            extra_headers=route(decode),
            extra_body={"nvext": {"extra_fields": ["worker_id"]}, "ignore_eos": True},
        )
        assert out.usage.completion_tokens == 3
        assert (await served(prefill))["total"] == 0
        (d,) = (await served(decode))["recent"]
        assert not d["kv_transfer"] and d["cached_tokens"] == 0  # prefilled by the decode worker
        assert out.model_extra["nvext"]["worker_id"] == {
            "decode_worker_id": decode.config.instance_id
        }
        assert await frontend_metric(fe, "dynamograph_frontend_requests_total", disagg="false") == 1

    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(decode, [prefill, decode], enforce_disagg=True) as fe,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client(fe).completions.create(
                model=model, prompt=PROMPT, max_tokens=3, extra_headers=route(decode)
            )
        assert "--enforce-disagg" in refused.value.message
        assert "x-prefill-instance-id" in refused.value.message
        assert (await served(prefill))["total"] == 0 and (await served(decode))["total"] == 0
