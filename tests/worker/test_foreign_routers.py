"""Foreign routers route to our mock workers unmodified: PyPI `sglang-router` and `vllm-router`.

Both are launched on 127.0.0.1 with Hugging Face offline (HF_ENDPOINT points at a closed port),
in front of two in-process mock workers; requests go through them with the official `openai`
client, and each worker's own request log shows what it served.
"""

import asyncio
import contextlib
import os
import shutil
import sys

import aiohttp
import openai
import pytest

from dynamograph.worker.server import WORKER_ID_HEADER
from dynamograph.worker.testing import free_port, mock_worker, stop_process
from e2e.waiting import wait_for

from .conftest import MODEL

pytestmark = pytest.mark.anchor

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def router_command(kind: str, port: int, metrics_port: int, workers: list[str], policy: str):
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
              "--policy", policy, "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
              "--worker-startup-timeout-secs", "60"]  # fmt: skip
    if kind == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router", *common]
    exe = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    return [exe, *common]


def require(kind: str) -> None:
    module = {"sglang": "sglang_router", "vllm": "vllm_router"}[kind]
    pytest.importorskip(module, reason=f"PyPI {kind}-router is not installed")
    if kind == "vllm" and not shutil.which("vllm-router", path=os.path.dirname(sys.executable)):
        pytest.skip("the vllm-router executable is not installed beside this Python")


@contextlib.asynccontextmanager
async def router(kind: str, workers: list[str], policy: str):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *router_command(kind, port, free_port(), workers, policy),
        env={**os.environ, **OFFLINE},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, proc)
        yield url
    finally:
        await stop_process(proc)


async def wait_ready(url: str, proc, within: float = 90.0) -> None:
    """Ready when a completion goes through (both routers first health-check the workers)."""
    body = {"model": MODEL, "prompt": "ready?", "max_tokens": 1}
    async with aiohttp.ClientSession() as http:

        async def routed_or_exited() -> str | None:
            if proc.returncode is not None:
                return "exited"
            async with http.post(url + "/v1/completions", json=body) as resp:
                return "routed" if resp.status == 200 else None

        outcome = await wait_for(
            routed_or_exited, f"router at {url} to route a request", within=within, interval=0.25
        )
    assert outcome == "routed", f"router exited with {proc.returncode}"


async def served(worker) -> int:
    async with aiohttp.ClientSession() as http, http.get(worker.url + "/debug/requests") as r:
        return (await r.json())["total"]


async def exercise(url: str) -> None:
    """Completions and chat, streaming and not, through the router with the openai client."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
        for i in range(4):
            done = await c.completions.create(model=MODEL, prompt=f"route me {i}", max_tokens=4)
            assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
        stream = await c.completions.create(
            model=MODEL, prompt="stream me", max_tokens=3, stream=True
        )
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        assert len(text.split()) == 3  # one word per token (a chunk may carry several)
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 2
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        deltas = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        assert len("".join(deltas).split()) == 3


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_round_robin_reaches_both_mock_workers(kind):
    require(kind)
    async with (
        mock_worker(model=MODEL) as a,
        mock_worker(model=MODEL) as b,
        router(kind, [a.url, b.url], "round_robin") as url,
    ):
        before = (await served(a), await served(b))
        await exercise(url)
        after = (await served(a), await served(b))
    got = (after[0] - before[0], after[1] - before[1])
    assert sum(got) == 7  # exercise() sends 7 requests
    assert got[0] >= 3 and got[1] >= 3, f"round robin split 7 requests as {got}"


async def test_vllm_router_cache_aware_reuses_the_cached_prefix():
    """vllm-router's cache_aware policy tokenizes through our render/tokenize endpoints and
    sends a repeated prefix back to the worker that caches it."""
    require("vllm")
    prompt = "Tell me about the history of the Roman empire in great detail. " * 20
    async with (
        mock_worker(model=MODEL) as a,
        mock_worker(model=MODEL) as b,
        router("vllm", [a.url, b.url], "cache_aware") as url,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c,
    ):
        raws = [
            await c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
            for _ in range(2)
        ]
    first, second = (raw.parse() for raw in raws)
    served_by = [raw.headers[WORKER_ID_HEADER] for raw in raws]
    assert served_by[0] == served_by[1], f"the repeated prefix went elsewhere: {served_by}"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
