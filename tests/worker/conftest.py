"""Shared fixtures: real mock workers on 127.0.0.1 (in-process unless a test needs the CLI)."""

import orjson
import pytest

from dynamograph.worker.testing import mock_worker

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
