"""`--mode kv`: without a gateway the frontend picks with the router core itself, fed by the
workers' KV events (or, with `--kv-events off`, by what it routed)."""

import asyncio
import contextlib

import openai
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.protocol.engine import Role
from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.tokenization import get_tokenizer
from dynamograph.router import tokenizers
from dynamograph.worker.testing import mock_worker, word_level_tokenizer, worker_process
from e2e.waiting import wait_for

from .conftest import client, route, run_frontend, served

pytestmark = pytest.mark.integration

PROMPT = "A shared system prompt that many requests repeat, word for word. " * 10


def cached_blocks(fe, prompt: str) -> int:
    """How many of the prompt's blocks the frontend's router believes are cached somewhere."""
    from dynamograph.router.scheduler import RouteRequest

    router = fe.routing.router
    tokens = get_tokenizer("qwen").encode(prompt, add_special_tokens=True)
    decision = router.schedule(
        RouteRequest("probe", block_hashes(tokens, router.block_size), len(tokens), query_only=True)
    )
    return decision.decode.overlap_blocks


@pytest.mark.parametrize("kv_events", [True, False])
async def test_repeated_prefix_sticks_to_the_worker_that_cached_it(model, kv_events):
    async with (
        mock_worker() as a,
        mock_worker() as b,
        run_frontend(None, [a, b], mode=Mode.KV, kv_events=kv_events) as fe,
    ):
        api = client(fe)
        await api.completions.create(model=model, prompt=PROMPT, max_tokens=1)
        first = a if (await served(a))["total"] else b
        await wait_for(
            lambda: cached_blocks(fe, PROMPT) > 0, what="the router to learn the cached prefix"
        )
        for _ in range(4):
            out = await api.completions.create(model=model, prompt=PROMPT, max_tokens=1)
            assert out.usage.prompt_tokens_details.cached_tokens > 0
        assert (await served(first))["total"] == 5
        # Bookings are released when requests end: nothing stays active in the router.
        assert fe.routing.router.active.total_requests() == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_the_response_head_reads_the_queued_kv_events(model, stream):
    """Once a streaming engine's response head is in (it is then prefilling), or a whole answer
    has gone out, the frontend reads the KV events queued since its pick, as the EPP does after
    a response's headers: the next pick finds fewer left to read on its path."""
    async with mock_worker() as worker, run_frontend(None, [worker], mode=Mode.KV) as fe:
        pipeline, active = fe.routing.pipeline, fe.routing.router.active
        read = pipeline.read_events
        booked_at_reads: list[int] = []

        def counting_read() -> None:
            booked_at_reads.append(active.total_requests())
            read()

        pipeline.read_events = counting_read
        api = client(fe)
        if stream:
            async for _ in await api.completions.create(
                model=model, prompt=PROMPT, max_tokens=4, stream=True
            ):
                pass
        else:
            await api.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        # the pick's read (nothing booked yet), then one while the request is under way
        assert booked_at_reads == [0, 1]


async def test_kv_mode_runs_the_handoff_and_honours_pins(model):
    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        mock_worker() as pinned,
        run_frontend(None, [prefill, decode, pinned], mode=Mode.KV) as fe,
    ):
        api = client(fe)
        out = await api.completions.create(
            model=model, prompt=PROMPT, max_tokens=2, extra_headers=route(decode)
        )
        assert out.usage.prompt_tokens_details.cached_tokens > 0  # pulled from the prefill
        assert (await served(prefill))["total"] == 1 and (await served(decode))["total"] == 1
        await api.completions.create(
            model=model, prompt="x", max_tokens=1, extra_headers=route(pinned)
        )
        assert (await served(pinned))["total"] == 1


async def test_busy_workers_refuse_with_503_and_retry_after(model):
    """Dynamo's busy rule: every worker busy → 503 (not 429) with Retry-After."""
    from dynamograph.protocol.router_config import RouterConfig

    async with (
        mock_worker(num_gpu_blocks=64, speedup=1.0) as small,
        run_frontend(
            None, [small], mode=Mode.KV, router=RouterConfig(busy_threshold=0.05, retry_after_s=2)
        ) as fe,
    ):
        api = client(fe)
        long_running = asyncio.create_task(
            api.completions.create(
                model=model, prompt=PROMPT, max_tokens=800, extra_body={"ignore_eos": True}
            )
        )
        await wait_for(lambda: fe.routing.router.active.total_requests() == 1, what="booking")
        with pytest.raises(openai.InternalServerError) as info:
            await api.completions.create(model=model, prompt="one more", max_tokens=1)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "2"
        assert "retry after 2 s" in info.value.body["message"]
        long_running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long_running
        await wait_for(
            lambda: fe.routing.router.active.total_requests() == 0, what="the booking to be freed"
        )


async def test_kv_mode_with_a_hugging_face_tokenizer(tmp_path):
    """A worker publishing a Hugging Face tokenizer (`hf:<path>`) is routed in kv mode (it was a
    500: the frontend loaded the published identity as a path)."""
    words = word_level_tokenizer(tmp_path)
    prompt = " ".join(words[i % len(words)] for i in range(80))
    async with (
        mock_worker(tokenizer=str(tmp_path)) as worker,
        run_frontend(None, [worker], mode=Mode.KV) as fe,
    ):
        assert worker.config.tokenizer.startswith("hf:")
        api = client(fe)
        answer = await api.completions.create(
            model=worker.config.served_model_name, prompt=prompt, max_tokens=2
        )
        assert answer.usage.prompt_tokens == 80  # one token a word: the worker's tokenizer
    assert fe.routing.router.active.total_requests() == 0


async def test_kv_mode_holds_a_worker_whose_tokenizer_it_cannot_load(tmp_path, monkeypatch):
    """The worker (a process of its own) publishes a tokenizer.json the frontend cannot read:
    its requests get 503 saying so instead of a failed tokenization, and once the file is
    there the worker is routed again (the same `router.tokenizers` as the EPP's)."""
    monkeypatch.setattr(tokenizers, "RETRY_S", 0.2)
    vocabulary = tmp_path / "words"
    vocabulary.mkdir()
    words = word_level_tokenizer(vocabulary)
    async with worker_process("--tokenizer", str(vocabulary)) as worker:
        hidden = tmp_path / "elsewhere"
        vocabulary.rename(hidden)
        async with run_frontend(None, [worker], mode=Mode.KV) as fe:
            loads = fe.routing.tokenizers
            await wait_for(lambda: worker.config.instance_id in loads.held_workers(), "a hold")
            api = client(fe)
            with pytest.raises(openai.APIStatusError) as refused:
                await api.completions.create(
                    model=worker.config.served_model_name, prompt=" ".join(words), max_tokens=1
                )
            assert refused.value.status_code == 503
            hidden.rename(vocabulary)
            await wait_for(lambda: not loads.held_workers(), "the worker to be released")
            answer = await api.completions.create(
                model=worker.config.served_model_name, prompt=" ".join(words), max_tokens=1
            )
            assert answer.usage.prompt_tokens == len(words)
