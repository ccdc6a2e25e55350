"""Bounded polling waits shared by every test suite (tests/ and both e2e suites).

No test sleeps for a fixed time and hopes: every wait polls a condition with a generous deadline
and, when it gives up, says what it waited for and what it saw last.
"""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

_FIRST_INTERVAL = 0.01


class WaitTimeout(AssertionError):
    """A condition did not hold within its deadline (an assertion failure, not an error)."""


def _message(what: str, timeout: float, last: Any, detail: Callable[[], str] | None) -> str:
    text = f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r:.800}"
    if detail is not None:
        try:
            text += "\n" + detail()
        except Exception as exc:  # diagnostics must never hide the timeout itself
            text += f"\n(no detail: {exc!r})"
    return text


async def wait_for(
    probe: Callable[[], Any | Awaitable[Any]],
    what: str,
    *,
    within: float = 60.0,
    interval: float = 0.2,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Call `probe` (sync or async) until it returns a truthy value, and return that value.

    Probes start 10 ms apart and back off to `interval`, so a condition that holds almost at
    once is seen at once and a long wait costs few probes. Exceptions from the probe count as
    "not yet" (a server still starting refuses connections) and are reported as the last
    observation when the deadline passes, followed by `detail()` (e.g. the kubelet's pod table
    and log tails).
    """
    deadline = time.monotonic() + within
    delay = min(_FIRST_INTERVAL, interval)
    last: Any = None
    while True:
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:  # a probe failing is an observation, not the end of the wait
            value, last = None, exc
        else:
            last = value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(_message(what, within, last, detail))
        await asyncio.sleep(delay)
        delay = min(delay * 2, interval)


def wait_for_sync(
    probe: Callable[[], Any],
    what: str,
    *,
    within: float = 60.0,
    interval: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    detail: Callable[[], str] | None = None,
) -> Any:
    """The blocking twin of `wait_for`, for the kind suite's kubectl polling."""
    deadline = clock() + within
    last: Any = None
    while True:
        try:
            value = probe()
        except Exception as exc:
            value, last = None, exc
        else:
            last = value
        if value:
            return value
        if clock() >= deadline:
            raise WaitTimeout(_message(what, within, last, detail))
        sleep(interval)
