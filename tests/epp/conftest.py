"""Shared fixtures and helpers for the EPP tests."""

import asyncio


async def eventually(predicate, within: float = 10.0, interval: float = 0.01):
    """Poll predicate() until it holds (bounded): the state lives in another task or process."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - polling state with no event to wait on
            await asyncio.sleep(interval)
