"""Stopping background tasks: the one way the EPP's long-running loops are shut down."""

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel every task, then wait for each to finish; their errors are already logged by them."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
