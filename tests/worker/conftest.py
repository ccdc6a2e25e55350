"""Shared fixtures: real mock workers on 127.0.0.1 (in-process unless a test needs the CLI)."""

import pytest

from dynamograph.worker.testing import mock_worker

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
async def worker():
    async with mock_worker(model=MODEL) as w:
        yield w
