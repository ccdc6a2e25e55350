"""Shared fixtures: real mock workers on 127.0.0.1 (in-process unless a test needs the CLI)."""

import argparse
import asyncio
import contextlib

import orjson
import pytest

from dynamograph.worker import cli as worker_cli
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
async def worker():
    async with mock_worker(model=MODEL) as w:
        yield w


async def post_json(url, path, body, *, headers=None, expect=200):
    """POST JSON, assert the status, return the decoded body (None when empty)."""
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, json=body, headers=headers or {}) as resp,
    ):
        raw = await resp.read()
        assert resp.status == expect, raw[:500]
        return orjson.loads(raw) if raw else None


@contextlib.asynccontextmanager
async def serve_asgi(app):
    """uvicorn serving an ASGI app in this event loop on a free 127.0.0.1 port; yields the base
    URL. What vLLM serves its app with, so middleware of ours is tested behind the same server."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the test runner owns the signals
            yield

    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, lifespan="off", log_config=None, access_log=False
    )
    server = Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or task.done(), "uvicorn to start", within=10)
        if not server.started:
            if task.done():
                task.result()  # raises what stopped it
            raise RuntimeError("uvicorn did not start")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def worker_args(*argv: str) -> argparse.Namespace:
    """`dynamograph worker`'s flags as its parser reads them."""
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(list(argv))
