"""A backlog as an event loop sees it, for the tests of admission by loop lag (the EPP's and a
kv-mode frontend's, router/admission.py)."""

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loop_hogged(busy_s: float = 0.3) -> Iterator[None]:
    """Within the block, the running loop is kept busy `busy_s` at a time (one callback after
    another, each blocking it: the CPU work of a backlog); it keeps time again after it."""
    loop = asyncio.get_running_loop()
    hogging = True

    def hog() -> None:
        time.sleep(busy_s)
        if hogging:
            loop.call_soon(hog)

    loop.call_soon(hog)
    try:
        yield
    finally:
        hogging = False
